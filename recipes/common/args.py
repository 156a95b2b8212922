"""The command-line flags every recipe shares, so `--help` reads the same on all three."""

from __future__ import annotations

import argparse
import sys

from .modeling import DEFAULT_MODEL


def recipe_parser(doc: str) -> argparse.ArgumentParser:
    summary, _, details = doc.partition("\n")
    parser = argparse.ArgumentParser(
        # no abbreviations: which flags were typed must be known exactly (see `parse_args`)
        description=summary, epilog=details, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    add = parser.add_argument
    add("--model", default=str(DEFAULT_MODEL),
        help="hub id or local folder (default: the bundled tiny Llama, built on first use)")
    add("--dataset", default=None,
        help="hub id, local folder, or .jsonl/.json/.parquet/.txt file (default: the bundled data/)")
    add("--columns", default=None,
        help="rename dataset columns to a known format, e.g. instruction=question,response=answer")
    add("--packing", action="store_true",
        help="pack several rows into each --max-length sequence (attention stays within each row)")
    add("--output-dir", default="outputs/run", help="where run.json, metrics, checkpoints and the result go")
    add("--epochs", type=float, default=1, help="passes over the training data (ignored when --max-steps > 0)")
    add("--max-steps", type=int, default=0, help="optimizer steps to run; 0 = use --epochs")
    add("--batch-size", type=int, default=8, help="micro-batch size per process")
    add("--grad-accum", type=int, default=1, help="micro-batches accumulated per optimizer step")
    add("--lr", type=float, default=2e-4, help="peak learning rate (linear warm-up, cosine decay)")
    add("--warmup-ratio", type=float, default=0.03, help="fraction of the steps spent warming up")
    add("--weight-decay", type=float, default=0.0)
    add("--max-grad-norm", type=float, default=1.0, help="gradient clipping, the same on every strategy")
    add("--max-length", type=int, default=512, help="tokens per example; longer examples are truncated")
    add("--seed", type=int, default=42)
    add("--eval-every", type=int, default=0, help="evaluate every N steps (0: only at the end)")
    add("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    add("--save-total-limit", type=int, default=0, help="keep only the newest N checkpoints (0: keep all)")
    add("--resume", default=None, help="a checkpoint folder to resume from, or `auto` for the newest")
    add("--gradient-checkpointing", nargs="?", type=int, const=1, default=0, metavar="EVERY_N",
        help="recompute activations in the backward to save memory; bare: every layer, N: every Nth layer "
             "only (selective: less recompute, more memory)")
    # Speed: the defaults are the measured winners (README, "Speed options"); these switch extras on.
    add("--compile", action="store_true", help="torch.compile each decoder layer (regional compilation)")
    add("--liger", action="store_true", help="Liger's Triton kernels (fused cross-entropy, RMSNorm, ...); "
        "needs `pip install liger-kernel` and a CUDA GPU")
    add("--attention", default=None, choices=("sdpa", "eager", "flash_attention_2", "flex_attention"),
        help="attention implementation (default: transformers' choice, SDPA)")
    add("--dataloader-workers", type=int, default=None,
        help="processes that collate batches beside each rank (default: 2 with a GPU, 0 without)")
    add("--log-every", type=int, default=None,
        help="print a line every N steps (default: every step when no progress bar is shown, else none)")
    add("--report-to", default="auto", choices=("auto", "none", "tensorboard", "wandb", "trackio"),
        help="accelerate tracker that receives the metrics too (auto: TensorBoard when installed)")
    add("--trust-remote-code", action="store_true",
        help="run the model repository's own Python code (off: only transformers' built-in models)")
    return parser


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--lora-r", type=int, default=16, help="adapter rank")
    add("--lora-alpha", type=int, default=32, help="adapter scale numerator (scale = alpha / r)")
    add("--lora-dropout", type=float, default=0.05)
    add("--lora-targets", default="all-linear",
        help="comma-separated module names to adapt, or `all-linear` (default)")
    add("--merge", action="store_true", help="also write merged/ : the adapter merged into the base weights")


def add_qlora_args(parser: argparse.ArgumentParser) -> None:
    add_lora_args(parser)
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4, help="4 = NF4 (QLoRA), 8 = LLM.int8()")


def recipe_flags(recipe: str, doc: str = "recipe\n") -> argparse.ArgumentParser:
    """The flags of `recipes/<recipe>.py` (`doc` is its --help text); tools that check a launch
    without running it use the same parser."""
    parser = recipe_parser(doc)
    parser.set_defaults(recipe=recipe)  # not a flag: what checkpoints and run.json record
    if recipe == "full":
        parser.set_defaults(lr=2e-5)  # every weight moves: a LoRA-sized step would wreck the model
    elif recipe == "lora":
        add_lora_args(parser)
    else:
        add_qlora_args(parser)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed flags, plus `given_flags`: the ones typed on the command line. A setting in the
    user's DeepSpeed config may fill a flag left at its default, but never override a typed one."""
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.given_flags = sorted({action.dest for action in parser._actions for option in action.option_strings
                               if any(arg == option or arg.startswith(option + "=") for arg in argv)})
    return args


def lora_targets(value: str):
    return value if value == "all-linear" else [name.strip() for name in value.split(",") if name.strip()]
