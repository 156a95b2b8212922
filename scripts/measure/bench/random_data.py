"""The offline data: rows of random words that the bundled tokenizer cuts to exactly --max-length tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path

from bench.paths import TOKENIZER_DIR

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega matrix vector tensor kernel "
         "shard gather reduce scatter gradient adapter layer token batch epoch memory device stream cache "
         "model train loss step rank node queue table graph value index").split()


def random_text(rng: random.Random, chars: int) -> str:
    words = []
    length = 0
    while length < chars:
        word = rng.choice(WORDS) if rng.random() < 0.8 else str(rng.randrange(10**6))
        words.append(word)
        length += len(word) + 1
    return " ".join(words)


def ensure_data(folder: Path, rows: int, length: int, eval_rows: int = 16, seed: int = 0) -> Path:
    """`folder`/train.jsonl: `rows` rows of a `text` column, each cut by --max-length `length` to exactly
    `length` tokens (BOS + `length - 1` targets), checked with the bundled tokenizer and the recipes'
    own tokenisation; eval.jsonl: `eval_rows` short rows, so that the recipe trains on all `rows` rows
    (it holds 5% out only when there is no evaluation split) and its end-of-run evaluation is cheap."""
    meta = {"rows": rows, "max_length": length, "eval_rows": eval_rows, "seed": seed, "format": "text"}
    if (folder / "meta.json").exists() and json.loads((folder / "meta.json").read_text()) == meta:
        return folder
    from transformers import AutoTokenizer

    from common.data.targets import tokenize_row

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    rng = random.Random(seed)

    def row_of(tokens: int) -> str:
        text = random_text(rng, int(tokens * 1.2) + 16)
        while len(tokenizer(text, add_special_tokens=False)["input_ids"]) < tokens:
            text += " " + random_text(rng, tokens // 4 + 16)
        return text

    train = [row_of(length) for _ in range(rows)]
    for text in train:
        tokens = tokenize_row({"text": text}, tokenizer, "text", length)
        targets = sum(label != -100 for label in tokens["labels"][1:])
        if len(tokens["input_ids"]) != length or targets != length - 1:
            raise RuntimeError(f"a generated row tokenises to {len(tokens['input_ids'])} tokens, not {length}")
    short = max(8, min(32, length // 4))
    evaluation = [random_text(rng, short) for _ in range(eval_rows)]
    folder.mkdir(parents=True, exist_ok=True)
    for name, texts in (("train.jsonl", train), ("eval.jsonl", evaluation)):
        with open(folder / name, "w") as file:
            for text in texts:
                file.write(json.dumps({"text": text}) + "\n")
    (folder / "meta.json").write_text(json.dumps(meta) + "\n")
    return folder

