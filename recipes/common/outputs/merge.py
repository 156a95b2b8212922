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
from common.model.modeling import bits_config


def merge(base: str, adapter: str, output: str, base_4bit: bool = False, dtype: str = "auto") -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if base_4bit:
        compute_dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        quantization = bits_config(4, compute_dtype)
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(
            base, quantization_config=quantization, device_map={"": device}, dtype=compute_dtype
        ).dequantize()
    else:
        model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    if dtype != "auto":  # after the merge, which adds the adapter's update in the base's precision
        merged = merged.to(getattr(torch, SAVE_DTYPES[dtype]))
    merged.save_pretrained(output, safe_serialization=True)
    AutoTokenizer.from_pretrained(adapter).save_pretrained(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the base model the adapter was trained on")
    parser.add_argument("--adapter", required=True, help="folder written as adapter/ by a recipe")
    parser.add_argument("--output", required=True, help="where to write the merged model")
    parser.add_argument("--base-4bit", action="store_true", help="the adapter was trained on an NF4 base (QLoRA)")
    parser.add_argument("--dtype", default="auto", choices=("auto", *SAVE_DTYPES),
                        help="dtype of the merged weights (auto: the base's)")
    args = parser.parse_args()
    merge(args.base, args.adapter, args.output, args.base_4bit, args.dtype)


if __name__ == "__main__":
    main()
