#!/usr/bin/env python
"""Merge a LoRA adapter a recipe saved into its base, any time after the run: a plain transformers model.

    python scripts/merge.py outputs/lora/adapter outputs/lora/merged [--dtype bf16]

The base is the one the adapter names (its adapter_config.json); an adapter trained on a 4-bit base (qlora.py,
or dpo.py --bits 4: its run.json beside it says so) is merged onto that base dequantized, the weights it was
trained against. The merged folder loads with AutoModelForCausalLM.from_pretrained and, with the adapter's
tokenizer and chat template, with scripts/generate.py. What `--merge` writes at the end of a run, later.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
import common.quiet  # noqa: E402, F401  (the recipes' notice filter first, as in the recipes)

from common.launching.args import SAVE_DTYPES  # noqa: E402
from common.model import adapters  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("adapter", help="the adapter/ folder a recipe saved")
    parser.add_argument("output", help="where to write the merged model")
    parser.add_argument("--dtype", default="auto", choices=("auto", *SAVE_DTYPES),
                        help="dtype of the merged weights (default auto: the base's)")
    parser.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args(argv)
    base = adapters.adapter_base(args.adapter)
    if base is None:
        parser.error(f"{args.adapter} is not a LoRA adapter folder (no adapter_config.json naming its base); give "
                     "the adapter/ folder a recipe saved")
    if Path(args.output).exists() and any(Path(args.output).iterdir()):
        parser.error(f"{args.output} is not empty; give a new folder")
    import torch

    four_bit = adapters.trained_on_4bit(args.adapter)
    adapters.merge(base, args.adapter, args.output, base_4bit=four_bit,
                   dtype=None if args.dtype == "auto" else getattr(torch, SAVE_DTYPES[args.dtype]),
                   trust_remote_code=args.trust_remote_code)
    print(f"merged {args.adapter} onto {base}{' (its 4-bit base, dequantized)' if four_bit else ''}: {args.output}")


if __name__ == "__main__":
    main()
