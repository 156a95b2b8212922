#!/usr/bin/env python
"""The inputs of this folder's launches, written under OUT: two models with a 32,768-token context and rows of
about 8,000 and 16,000 tokens.

- `bundled-long`: the bundled tiny Llama (models/tiny-llama: hidden 64, 2 layers) with its context raised
  (its positions are rotary: nothing learned depends on the length);
- `wide`: a CPU stand-in whose activations outweigh the processes' own memory (hidden 512, 4 layers, 8 heads,
  4 key-value heads, random weights, the bundled tokenizer);
- `rows-8k.jsonl`, `rows-16k.jsonl`: 6 plain-text rows each, words of the bundled tokenizer's vocabulary.

    python make_inputs.py OUT
"""

import json
import random
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
WORDS = ["sort", "copy", "reverse", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    bundled = REPO / "models" / "tiny-llama"
    long_model = out / "bundled-long"
    shutil.copytree(bundled, long_model, dirs_exist_ok=True)
    config = json.loads((long_model / "config.json").read_text())
    (long_model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}, indent=1))

    wide = AutoConfig.from_pretrained(long_model)
    wide.update(dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=64))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(wide).save_pretrained(out / "wide")
    AutoTokenizer.from_pretrained(bundled).save_pretrained(out / "wide")

    tokenizer = AutoTokenizer.from_pretrained(bundled)
    generator = random.Random(0)
    for name, tokens in (("8k", 8000), ("16k", 16000)):
        with open(out / f"rows-{name}.jsonl", "w") as file:
            for _ in range(6):
                words = []
                while len(tokenizer(" ".join(words))["input_ids"]) < tokens:
                    words += [generator.choice(WORDS) for _ in range(200)]
                file.write(json.dumps({"text": " ".join(words)}) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
