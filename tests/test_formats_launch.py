"""A chat dataset, packed, through a real 2-process launch: detected, trained, exported."""

from __future__ import annotations

import json
import re

from conftest import REPO, TINY_MODEL, launch


def test_packed_chat_data_trains_under_ddp(tmp_path):
    dataset = tmp_path / "chat.jsonl"
    with open(REPO / "data" / "train.jsonl") as source, open(dataset, "w") as out:
        for line in list(source)[:512]:
            row = json.loads(line)
            messages = [{"role": "user", "content": row["instruction"]}, {"role": "assistant", "content": row["response"]}]
            out.write(json.dumps({"messages": messages}) + "\n")
    run = launch("lora", tmp_path / "out", "--dataset", str(dataset), "--packing", "--max-length", "128",
                 "--max-steps", "12", "--batch-size", "2", "--lr", "5e-3", config="ddp")
    assert run.returncode == 0, run.output[-3000:]
    assert run.run_json()["data_format"] == "messages"
    assert "data format: messages" in run.output
    # the bundled tokenizer has no chat template: the one the rows were rendered with is named
    assert (f"data: chat rows rendered with the plain default (`<|user|>` / `<|assistant|>` turns), as {TINY_MODEL}'s "
            "tokenizer has none (--chat-template FILE for another); the tokenizer saved with the model carries it"
            ) in run.output
    assert "data cache: " in run.output  # where a rerun reads the tokenised rows from
    packing = next(line for line in run.output.splitlines() if line.startswith("packing: "))
    assert re.fullmatch(r"packing: 48\d training rows into \d+ sequences of up to 128 tokens, \d+\.\d% full; a "
                        r"micro-batch of 2 holds ~\d+ rows \(~\d+ tokens\): the memory of 2 full sequences, so a "
                        r"smaller --batch-size keeps an unpacked run's", packing), packing
    rows, sequences = map(int, re.findall(r"([\d,]+) (?:training rows|sequences)", packing)[:2])
    assert f"holds ~{2 * rows / sequences:,.0f} rows" in packing
    losses = run.losses()
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    # Packed: each micro-batch of 2 sequences carries many rows' targets.
    assert min(record["tokens"] for record in run.metrics()) > 2 * 2 * 8
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
