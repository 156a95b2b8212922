"""Merge a LoRA adapter into its base model and save a plain transformers model.

    python recipes/common/outputs/merge.py --base BASE --adapter OUT/adapter --output OUT/merged [--base-4bit] [--dtype bf16]

The recipes run this in a fresh process after training (a clean process needs no FSDP or
ZeRO-3 collectives to load a model); it also works on its own, any time after a run. With
--base-4bit the base is loaded in NF4, as QLoRA trained against it, and dequantized before the
merge, so the merged weights are the ones the adapter was trained with.
"""

import argparse
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the recipes' notice filter first, as in the recipes
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import common.quiet  # noqa: F401

import torch

from common.launching.args import SAVE_DTYPES
from common.model import adapters


def merge(base: str, adapter: str, output: str, base_4bit: bool = False, dtype: str = "auto", reward: bool = False) -> None:
    """adapters.merge with `dtype` a --save-dtype name (auto: the base's)."""
    adapters.merge(base, adapter, output, base_4bit, None if dtype == "auto" else getattr(torch, SAVE_DTYPES[dtype]),
                   reward=reward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the base model the adapter was trained on")
    parser.add_argument("--adapter", required=True, help="folder written as adapter/ by a recipe")
    parser.add_argument("--output", required=True, help="where to write the merged model")
    parser.add_argument("--base-4bit", action="store_true", help="the adapter was trained on an NF4 base (QLoRA)")
    parser.add_argument("--dtype", default="auto", choices=("auto", *SAVE_DTYPES),
                        help="dtype of the merged weights (auto: the base's)")
    parser.add_argument("--reward", action="store_true",
                        help="the adapter trained a reward model's score head (reward.py): save a sequence classifier")
    args = parser.parse_args()
    merge(args.base, args.adapter, args.output, args.base_4bit, args.dtype, args.reward)


if __name__ == "__main__":
    main()
