#!/usr/bin/env python
"""Merge a LoRA adapter a recipe saved into its base, any time after the run: a plain transformers model.

    python scripts/merge.py outputs/lora/adapter outputs/lora/merged [--dtype bf16]

The base is the one the adapter names (its adapter_config.json; a run's `base/` beside it is found there again
after the run's folder moved); an adapter trained on a 4-bit base (qlora.py, or dpo.py --bits 4: its run.json
beside it says so) is merged onto that base dequantized, the weights it was trained against. The merged folder
loads with AutoModelForCausalLM.from_pretrained and, with the adapter's tokenizer and chat template, with
scripts/generate.py. What `--merge` writes at the end of a run, later.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
import common.quiet  # noqa: E402, F401  (the recipes' notice filter first, as in the recipes)
from common.outputs.script_flags import merge_flags  # noqa: E402  (no torch)

if __name__ == "__main__":  # the flags read (--help, a mistyped one) before torch and transformers load: seconds
    merge_flags(__doc__).parse_args()

import torch  # noqa: E402

from common.launching.args import SAVE_DTYPES  # noqa: E402
from common.model import adapters  # noqa: E402


def main(argv=None) -> int:
    args = merge_flags(__doc__).parse_args(argv)
    base = adapters.adapter_base(args.adapter)
    if base is None:
        print(f"error: {args.adapter} is not a LoRA adapter folder (no adapter_config.json naming its base); give "
              "the adapter/ folder a recipe saved", file=sys.stderr)
        return 2
    if Path(args.output).exists() and any(Path(args.output).iterdir()):
        print(f"error: {args.output} is not empty; give a new folder", file=sys.stderr)
        return 2
    four_bit = adapters.trained_on_4bit(args.adapter)
    adapters.merge(base, args.adapter, args.output, base_4bit=four_bit,
                   dtype=None if args.dtype == "auto" else getattr(torch, SAVE_DTYPES[args.dtype]),
                   trust_remote_code=args.trust_remote_code)
    print(f"merged {args.adapter} onto {base}{' (its 4-bit base, dequantized)' if four_bit else ''}: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
