"""Formatting, masking and the token count that normalises the loss."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import REPO, TINY_MODEL

sys.path.insert(0, str(REPO / "recipes"))
from common import data  # noqa: E402
from common.preflight import Refusal  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_MODEL)


def test_formats_are_detected_from_columns():
    assert data.detect_format(["instruction", "response"]) == "instruction"
    assert data.detect_format(["instruction", "input", "output"]) == "instruction"
    assert data.detect_format(["prompt", "completion"]) == "prompt_completion"
    assert data.detect_format(["text", "id"]) == "text"
    with pytest.raises(Refusal, match="no usable text columns"):
        data.detect_format(["question", "answer_id"])


def test_only_the_response_and_eos_are_targets(tokenizer):
    row = data.tokenize_row({"instruction": "Sort: 3 1 2", "response": "1 2 3"}, tokenizer, "instruction", 512)
    targets = [t for t, label in zip(row["input_ids"], row["labels"]) if label != data.IGNORE]
    assert tokenizer.decode(targets) == "1 2 3" + tokenizer.eos_token
    assert row["input_ids"][0] == tokenizer.bos_token_id
    assert tokenizer.decode(row["input_ids"][1:]).startswith("### Instruction:\nSort: 3 1 2\n\n### Response:\n")


def test_plain_text_trains_on_every_token(tokenizer):
    row = data.tokenize_row({"text": "hello world"}, tokenizer, "text", 512)
    assert row["labels"][1:] == row["input_ids"][1:]


def test_padding_is_masked_and_counted_out(tokenizer):
    rows = [data.tokenize_row({"prompt": "a", "completion": c}, tokenizer, "prompt_completion", 512)
            for c in ("x", "a much longer completion")]
    batch = data.PadToLongest(tokenizer.pad_token_id)(rows)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert batch["attention_mask"][0].sum() == len(rows[0]["input_ids"])
    expected = sum(sum(label != data.IGNORE for label in row["labels"][1:]) for row in rows)
    assert data.target_tokens(batch) == expected


def test_micro_batch_losses_sum_to_the_token_mean_of_the_whole_step(tokenizer):
    """The recipes' normalisation: per-micro-batch losses over the step's token count add up to
    the mean over every target token of the step, not to a mean of micro-batch means."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    rows = [data.tokenize_row({"prompt": "p", "completion": "x " * n}, tokenizer, "prompt_completion", 512)
            for n in (1, 2, 30, 40)]
    collate = data.PadToLongest(tokenizer.pad_token_id)
    micro_batches = [collate(rows[:2]), collate(rows[2:])]
    step_tokens = sum(data.target_tokens(b) for b in micro_batches)
    with torch.no_grad():
        summed = sum(model(**b, num_items_in_batch=step_tokens).loss for b in micro_batches)
        whole = model(**collate(rows)).loss  # one batch: transformers' mean over its target tokens
        mean_of_means = sum(model(**b).loss for b in micro_batches) / 2
    assert torch.allclose(summed, whole, rtol=1e-5)
    assert not torch.allclose(mean_of_means, whole, rtol=1e-3)


def test_bundled_data_loads_with_its_own_eval_split():
    train, evaluation = data.load_splits(None, seed=0)
    assert len(train) >= 1024 and len(evaluation) > 0
    assert data.detect_format(train.column_names) == "instruction"
    assert not set(train["instruction"]) & set(evaluation["instruction"])


def test_a_single_file_gets_a_held_out_split(tmp_path):
    file = tmp_path / "rows.jsonl"
    file.write_text("".join(f'{{"text": "row {i}"}}\n' for i in range(100)))
    train, evaluation = data.load_splits(str(file), seed=0)
    assert len(train) == 95 and len(evaluation) == 5
