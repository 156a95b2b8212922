"""The flags of scripts/generate.py, scripts/evaluate.py and scripts/merge.py. Imports nothing heavy: each script reads its flags
(`--help`, a mistyped one) before torch and transformers load, which takes seconds."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..launching.args import SAVE_DTYPES, OneLineErrors


def run_or_model_flags(doc: str) -> argparse.ArgumentParser:
    """A script's parser that takes a run or a model (generate.py, evaluate.py), and --artifact."""
    summary, _, details = doc.partition("\n")
    # a mistyped flag: one line with the closest flags (argparse's usage block otherwise)
    parser = OneLineErrors(description=summary, epilog=details, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="RUN_OR_MODEL",
                        help="a recipe's --output-dir (with run.json), or any model: a folder (merged/, model/, "
                             "adapter/, a transformers model) or a hub id")
    parser.add_argument("--artifact", choices=("auto", "model", "merged", "adapter"), default="auto",
                        help="in a run's folder, what to load (default: auto, the first of model/, merged/, adapter/ "
                             "the run wrote)")
    return parser


def generate_flags(doc: str) -> argparse.ArgumentParser:
    parser = run_or_model_flags(doc)
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: one per line of stdin")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="(default: 64)")
    parser.add_argument("--raw", action="store_true", help="give the prompts to the model exactly as typed")
    parser.add_argument("--system", default=None, metavar="TEXT",
                        help="a chat prompt's system turn (default: the one every training row opened with, when "
                             "run.json recorded one; '': none)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (default); above 0: sample at this temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="sampling: keep the smallest set of tokens whose "
                        "probabilities add up to P (default: 1.0, all)")
    parser.add_argument("--seed", type=int, default=None, help="sampling: the same seed gives the same answers")
    parser.add_argument("--image", action="append", metavar="FILE",
                        help="an image given with every prompt, before its text (repeatable; a vision-language model)")
    return parser


def generate_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with generate.py's flags, in one line naming the fix; None when nothing."""
    if args.max_new_tokens < 1:
        return "--max-new-tokens must be >= 1"
    if args.temperature < 0:
        return "--temperature must be >= 0 (0: greedy)"
    if not 0 < args.top_p <= 1:
        return "--top-p must be in (0, 1]"
    if args.temperature == 0 and (args.top_p != 1.0 or args.seed is not None):
        return "--top-p and --seed apply to sampling: add --temperature T > 0"
    missing = [path for path in args.image or () if not Path(path).expanduser().is_file()]
    if missing:
        return f"--image {missing[0]} does not exist; give an image file"
    return None


def merge_flags(doc: str) -> argparse.ArgumentParser:
    parser = OneLineErrors(description=doc.split("\n\n")[0])
    parser.add_argument("adapter", help="the adapter/ folder a recipe saved")
    parser.add_argument("output", help="where to write the merged model")
    parser.add_argument("--dtype", default="auto", choices=("auto", *SAVE_DTYPES),
                        help="dtype of the merged weights (default auto: the base's)")
    parser.add_argument("--trust-remote-code", action="store_true")
    return parser


def evaluate_flags(doc: str) -> argparse.ArgumentParser:
    parser = run_or_model_flags(doc)
    parser.add_argument("--tasks", required=True, help="lm-eval task or group names, task YAMLs or folders of them, "
                        "comma-separated")
    parser.add_argument("--limit", type=int, default=None, help="score only the first N rows of each task")
    parser.add_argument("--batch-size", type=int, default=8, help="requests a forward, per process (default: 8)")
    parser.add_argument("--output", default=None, help="a JSON file for the scores (default: a run's "
                        "benchmarks.json; none for a model)")
    parser.add_argument("--raw-prompts", action="store_true", help="the tasks' raw text (default: as the run "
                        "trained: a run on chat rows through its chat template and system prompt; a model without "
                        "run.json: raw)")
    return parser
