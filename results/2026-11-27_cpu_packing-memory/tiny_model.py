#!/usr/bin/env python
"""The tiny Llama of the bundled shape (data/tiny-llama-config.json) with a sentencepiece-style
vocabulary of Mistral-7B's size: scripts/measure/data_speed.py's 32,000-piece tokenizer (built once, kept under
~/.cache/recipes/data_speed) with Llama-3.1's chat template, random weights, saved with the tokenizer.

    python tiny_model.py OUTPUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "measure"))


def main(output_dir: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from data_speed import sentencepiece_32k

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "recipes" / "data_speed"
    tokenizer = AutoTokenizer.from_pretrained(sentencepiece_32k(cache))
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    shape = json.loads((REPO / "data" / "tiny-llama-config.json").read_text())
    shape.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape))
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    print(f"{output_dir}: vocabulary {len(tokenizer):,}, {sum(p.numel() for p in model.parameters()):,} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
