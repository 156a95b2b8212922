"""The refusals that need no library: a flag, a file or a column that cannot work is answered before a recipe
imports torch, transformers and peft (seconds on a busy machine), in the same one line the full checks give.

Each recipe calls `refuse_before_loading` first; settle.settle_launch makes these checks again with the rest (they
are cheap), so a run started another way is held to them too. Imports nothing heavy: the flags, the files, the
columns of a file's first row.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import planner

from ..data.data_files import check_files, column_renames, folder_splits, looks_local, missing_source, saved_by_datasets
from ..data.formats import detect_format
from ..data.mixture import data_specs
from ..paths import is_default_model
from ..refusal import refuse
from ..rewards import reward_file
from .args import ONLINE_RECIPES, answer_help, parse_args, recipe_flags

SUPERVISED_RECIPES = ("lora", "qlora", "full")


def refuse_before_loading(recipe: str, doc: str) -> None:
    """--help answered, then the command line parsed and checked: its flags, the files it names (each line of a
    JSON Lines file read once: a later launch on the same files reads a mark), the supervised recipes' columns,
    grpo.py's reward files. Returns when nothing here refuses; the recipe then imports its libraries."""
    answer_help(recipe, doc)
    args = parse_args(recipe_flags(recipe, doc))
    check_flags(args, recipe)
    check_paths(args)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one reader a machine (the launcher stops the others if it refuses)
        check_local_files(args, recipe)
    if recipe in ONLINE_RECIPES:
        check_rewards(args)


def check_local_files(args, recipe: str) -> None:
    """Each local data file's lines (not UTF-8, not JSON, a list where text belongs: file:line), a folder's files
    (which split each is, one format, the same columns), and a supervised recipe given preference pairs is sent
    to dpo.py / reward.py, from the first row's columns. Hub datasets and datasets' saved folders are read where
    the recipe loads them."""
    for flag, spec in data_specs(args):
        path = Path(spec).expanduser() if spec else None
        if path is None or not path.exists() or saved_by_datasets(path):
            continue
        if path.is_file():
            columns = check_files([path], args.columns).get(path)
        else:
            _, splits, columns_of = folder_splits(path, args.columns)
            columns = columns_of.get(splits["train"][0])
        if recipe in SUPERVISED_RECIPES and columns and {"chosen", "rejected"} <= set(columns):
            renamed = {column_renames(args.columns).get(column, column) for column in columns}
            detect_format(renamed)  # refuses the pairs naming the recipes that take them, unless a format fits


def check_rewards(args) -> None:
    """grpo.py: a reward for prompts the user gives, each --reward naming a Python file that exists (what it
    defines is checked when the recipe imports it, with its libraries)."""
    if not args.reward and args.dataset:
        refuse("grpo.py needs a reward for your prompts: give --reward FILE.py:NAME, a function "
               "fn(prompts, completions, **columns) -> list[float | None] (recipes/rewards.py has examples)")
    for spec in args.reward or ():
        reward_file(spec)


def check_flags(args, recipe: str) -> None:
    """The flags' own values: in range, not empty, something to train, nothing asked that this run cannot do."""
    for flag in ("model", "dataset", "output_dir", "resume", "columns"):
        values = getattr(args, flag)
        if any(value is not None and not str(value).strip() for value in (values if isinstance(values, list) else [values])):
            refuse(f"--{flag.replace('_', '-')} is empty (an unset shell variable?); give a value or leave the flag out")
    check_ranges(args)
    if args.max_steps == 0 and args.epochs == 0:
        refuse("nothing to train: give --max-steps N or --epochs N (> 0)")
    check_columns(args.columns)
    if recipe != "full" and args.save_dtype != "auto" and not args.merge:
        refuse(f"--save-dtype {args.save_dtype} sets the dtype of merged/ (and full.py's model/), which this run does "
               "not write: add --merge, or drop --save-dtype (adapter/ keeps the adapter as trained)")


def check_paths(args) -> None:
    """--model, --dataset and --eval-dataset each name something here or a hub id: plan.py's placeholder words
    left in, and paths that do not exist, are refused before anything asks the hub (which tries a missing
    name 6 times over ~25 s, on every rank, before failing)."""
    if args.model == planner.MODEL_PLACEHOLDER and not Path(args.model).exists():
        refuse(f"--model {args.model} is the word plan.py's Launch line asks you to replace: give the hub id or "
               "folder of the model's weights")
    if looks_local(args.model) and not Path(args.model).expanduser().exists() and not is_default_model(args.model):
        refuse(f"--model {args.model} does not exist; give a local folder or a hub id such as "
               "TinyLlama/TinyLlama-1.1B-Chat-v1.0")
    for flag, spec in data_specs(args):
        missing = missing_source(flag, spec)
        if missing:
            refuse(missing)


# flag -> (low, high): a [low, high] or (low, high) bound on the value; None: unbounded
RANGES = {
    "max_steps": "[0, None)", "epochs": "[0, 1000000]", "batch_size": "[1, None)", "grad_accum": "[1, None)",
    "global_batch_size": "[1, None)",
    "max_length": "[1, None)", "lr": "(0, None)", "warmup_ratio": "[0, 1]", "weight_decay": "[0, None)",
    "max_grad_norm": "(0, None)", "eval_every": "[0, None)", "save_every": "[0, None)",
    "save_total_limit": "[0, None)", "log_every": "[0, None)", "gradient_checkpointing": "[0, None)",
    "dataloader_workers": "[0, None)", "lora_r": "[1, None)", "lora_alpha": "(0, None)", "lora_dropout": "[0, 1)",
    "seed": "[0, 4294967295]", "beta": "(0, None)", "simpo_gamma": "[0, None)",
}
# The online recipe's own bounds (grpo.py: --beta 0 is its default, no KL term)
ONLINE_RANGES = {
    "beta": "[0, None)", "num_generations": "[2, None)", "max_completion_length": "[1, None)", "temperature": "(0, None)",
    "top_p": "(0, 1]", "top_k": "[0, None)", "epsilon": "[0, 1)", "epsilon_high": "[0, None)",
    "num_iterations": "[1, None)", "samples_every": "[0, None)",
}
HINTS = {"max_grad_norm": " (clipping cannot be switched off, only raised: e.g. 1e9)",
         "save_every": " (0: none)"}


def check_ranges(args) -> None:
    """Every number a flag takes, checked against what the recipe can do with it."""
    ranges = {**RANGES, **ONLINE_RANGES} if getattr(args, "recipe", None) in ONLINE_RECIPES else RANGES
    for name, bounds in ranges.items():
        value = getattr(args, name, None)
        if value is None or value == "auto":
            continue
        flag = "--" + name.replace("_", "-")
        origin = getattr(args, "settled_from", {}).get(name)  # a value a config file set, not a typed flag
        flag += f" (set by {origin})" if origin else ""
        if not math.isfinite(value):
            refuse(f"{flag} must be a finite number, got {value}")
        low, high = (None if part.strip() == "None" else float(part) for part in bounds[1:-1].split(","))
        below = value < low or (value == low and bounds[0] == "(")
        above = high is not None and (value > high or (value == high and bounds[-1] == ")"))
        if below or above:
            if high is None:
                rule = f"{'>=' if bounds[0] == '[' else '>'} {low:g}"
            else:
                rule = f"in {bounds.replace('None', '')}".replace(".0", "")
            refuse(f"{flag} must be {rule}{HINTS.get(name, '')}, got {value}")


def check_columns(columns: str | None) -> None:
    """--columns is a comma-separated list of NEW=OLD renames."""
    for pair in (columns or "").split(",") if columns is not None else ():
        new, _, old = pair.partition("=")
        if not new.strip() or not old.strip():
            refuse(f"--columns entry `{pair}` is not NEW=OLD; write e.g. --columns instruction=question,response=answer")
