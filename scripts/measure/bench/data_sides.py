#!/usr/bin/env python
"""The sides scripts/measure/data_speed.py measures, each in a process of its own (so that its peak memory is
the side's alone):

    python scripts/measure/bench/data_sides.py limit --file rows.jsonl --tokenizer DIR
    python scripts/measure/bench/data_sides.py trl --file rows.jsonl --tokenizer DIR --max-length 1024
    accelerate launch ... scripts/measure/bench/data_sides.py recipes --tokenizer DIR -- <recipes/lora.py's flags>

- limit: every row rendered once (a chat row by the chat template, as text; an instruction row as
  formats.py's prompt + response), then one batched call of the fast tokenizer over all the texts
  (one per 20,000 texts, for memory), with character offsets: the least a data path that finds its
  targets by offsets can do.
- recipes: recipes/lora.py's start-up up to its data (its flags, the launch checks, the
  Accelerator), then `preparation.prepare` with the given tokenizer, timed between two barriers: files ->
  checked rows -> tokens and labels -> (with --packing) packed sequences. Alone, or under
  `accelerate launch`. What it kept and packed is in the recipes' own data and packing lines.
- trl: the file loaded with datasets and an SFTTrainer built on it, without training: TRL's own
  preparation of chat rows (`messages`) or prompt/completion rows. Its model, a random one of the
  bundled tiny Llama's shape and the tokenizer's vocabulary, is built before the clock starts.

Each prints one line `side: {json}` (each rank, for `recipes`) with its seconds and counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "recipes"))
TINY_CONFIG = REPO / "data" / "tiny-llama-config.json"
# The limit's texts per tokenizer call. A call's encodings and the lists made of them take ~200 bytes a
# token: 20,000 rows of the character-level tokenizer ~3 GB, one call over 200,000 of them ~30 GB.
TEXTS_PER_CALL = 20_000


def report(record: dict) -> None:
    sys.stdout.write(f"side: {json.dumps(record)}\n")  # one write: the ranks' lines do not cut into each other
    sys.stdout.flush()


def limit(file: Path, tokenizer_dir: Path) -> None:
    from common.data import formats
    from common.model import modeling

    tokenizer = modeling.load_tokenizer(str(tokenizer_dir))  # the template and pad token the recipes give it
    started = time.perf_counter()
    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    read = time.perf_counter()
    chat = "messages" in rows[0]
    if chat:
        texts = [tokenizer.apply_chat_template(row["messages"], tokenize=False) for row in rows]
    else:
        texts = ["".join(formats.split_prompt(row, "instruction")) for row in rows]
    rendered = time.perf_counter()
    tokens = 0
    for first in range(0, len(texts), TEXTS_PER_CALL):
        # the template writes BOS into a chat row; a plain row gets the tokenizer's own, as the recipes tokenise it
        encoded = tokenizer(texts[first:first + TEXTS_PER_CALL], add_special_tokens=not chat,
                            return_offsets_mapping=True, return_attention_mask=False)
        tokens += sum(map(len, encoded["input_ids"]))
        del encoded  # before the next call's: only one call's encodings are held at a time
    done = time.perf_counter()
    report({"rows": len(rows), "kept": len(texts), "tokens": tokens, "calls": -(-len(texts) // TEXTS_PER_CALL),
            "seconds": done - started, "read_seconds": read - started, "render_seconds": rendered - read,
            "tokenize_seconds": done - rendered})


def recipes(tokenizer_dir: Path, recipe_argv: list[str]) -> None:
    from common.launching import args as cli
    from common.data import preparation
    from common.launching import settle
    from common.model import modeling
    from common.training import runtime

    args, launch = settle.settle_launch(cli.parse_args(cli.recipe_flags("lora"), recipe_argv), recipe="lora")
    accelerator = runtime.make_accelerator(args, launch)
    tokenizer = modeling.load_tokenizer(str(tokenizer_dir), chat_template=args.chat_template)
    accelerator.wait_for_everyone()  # every rank starts the stage together
    started = time.perf_counter()
    preparation.prepare(accelerator, tokenizer, args, launch)
    accelerator.wait_for_everyone()  # the stage ends when the slowest rank is through it
    report({"rank": accelerator.process_index, "processes": accelerator.num_processes,
            "seconds": time.perf_counter() - started})
    accelerator.end_training()


def trl(file: Path, tokenizer_dir: Path, max_length: int, output_dir: Path) -> None:
    import datasets
    import pyarrow.compute as pc
    from common.model import modeling
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    tokenizer = modeling.load_tokenizer(str(tokenizer_dir))
    shape = json.loads(TINY_CONFIG.read_text())
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**shape, "vocab_size": len(tokenizer)}))
    config = SFTConfig(output_dir=str(output_dir), max_length=max_length, packing=False, report_to="none",
                       use_cpu=True, disable_tqdm=True, save_strategy="no", eval_strategy="no")
    started = time.perf_counter()
    rows = datasets.load_dataset("json", data_files=str(file), split="train")
    trainer = SFTTrainer(model=model, args=config, train_dataset=rows, processing_class=tokenizer)
    seconds = time.perf_counter() - started
    prepared = trainer.train_dataset.with_format("arrow")[:]  # the rows TRL kept, as one Arrow table
    report({"rows": len(rows), "kept": prepared.num_rows, "seconds": seconds,
            "tokens": int(pc.sum(pc.list_value_length(prepared.column("input_ids"))).as_py()),
            "dataset_num_proc": config.dataset_num_proc})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, recipe_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("side", choices=("limit", "recipes", "trl"))
    parser.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer folder")
    parser.add_argument("--file", type=Path, help="the rows (limit, trl)")
    parser.add_argument("--max-length", type=int, default=1024, help="trl's max_length")
    parser.add_argument("--output-dir", type=Path, help="trl's output_dir (nothing is written there)")
    args = parser.parse_args(ours)
    if args.side == "limit":
        limit(args.file, args.tokenizer)
    elif args.side == "trl":
        trl(args.file, args.tokenizer, args.max_length, args.output_dir)
    else:  # after `--`: recipes/lora.py's flags
        recipes(args.tokenizer, recipe_argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
