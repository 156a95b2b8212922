"""Formatting, masking and the token count that normalises the loss."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from conftest import REPO, TINY_MODEL

sys.path.insert(0, str(REPO / "recipes"))
from common.data import batches, checked_rows, formats, preparation, tokens  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_MODEL)


def test_formats_are_detected_from_columns():
    assert formats.detect_format(["instruction", "response"]) == "instruction"
    assert formats.detect_format(["instruction", "input", "output"]) == "instruction"
    assert formats.detect_format(["prompt", "completion"]) == "prompt_completion"
    assert formats.detect_format(["text", "id"]) == "text"
    with pytest.raises(Refusal, match="no usable text columns"):
        formats.detect_format(["question", "answer_id"])
    with pytest.raises(Refusal, match=r"these rows are preference pairs .*: train them with recipes/dpo.py"):
        formats.detect_format(["prompt", "chosen", "rejected"])


def test_only_the_response_and_eos_are_targets(tokenizer):
    row = tokens.tokenize_row({"instruction": "Sort: 3 1 2", "response": "1 2 3"}, tokenizer, "instruction", 512)
    targets = [t for t, label in zip(row["input_ids"], row["labels"]) if label != batches.IGNORE]
    assert tokenizer.decode(targets) == "1 2 3" + tokenizer.eos_token
    assert row["input_ids"][0] == tokenizer.bos_token_id
    assert tokenizer.decode(row["input_ids"][1:]).startswith("### Instruction:\nSort: 3 1 2\n\n### Response:\n")


def test_plain_text_trains_on_every_token(tokenizer):
    row = tokens.tokenize_row({"text": "hello world"}, tokenizer, "text", 512)
    assert row["labels"][1:] == row["input_ids"][1:]


def test_padding_is_masked_and_counted_out(tokenizer):
    rows = [tokens.tokenize_row({"prompt": "a", "completion": c}, tokenizer, "prompt_completion", 512)
            for c in ("x", "a much longer completion")]
    batch = batches.PadToLongest(tokenizer.pad_token_id)(rows)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert batch["attention_mask"][0].sum() == len(rows[0]["input_ids"])
    expected = sum(sum(label != batches.IGNORE for label in row["labels"][1:]) for row in rows)
    assert batches.target_tokens(batch) == expected


def test_micro_batch_losses_sum_to_the_token_mean_of_the_whole_step(tokenizer):
    """The recipes' normalisation: per-micro-batch losses over the step's token count add up to
    the mean over every target token of the step, not to a mean of micro-batch means."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    rows = [tokens.tokenize_row({"prompt": "p", "completion": "x " * n}, tokenizer, "prompt_completion", 512)
            for n in (1, 2, 30, 40)]
    collate = batches.PadToLongest(tokenizer.pad_token_id)
    micro_batches = [collate(rows[:2]), collate(rows[2:])]
    step_tokens = sum(batches.target_tokens(b) for b in micro_batches)
    with torch.no_grad():
        summed = sum(model(**b, num_items_in_batch=step_tokens).loss for b in micro_batches)
        whole = model(**collate(rows)).loss  # one batch: transformers' mean over its target tokens
        mean_of_means = sum(model(**b).loss for b in micro_batches) / 2
    assert torch.allclose(summed, whole, rtol=1e-5)
    assert not torch.allclose(mean_of_means, whole, rtol=1e-3)


def test_bundled_data_loads_with_its_own_eval_split():
    train, evaluation = checked_rows.load_splits(None, seed=0)
    assert len(train) >= 1024 and len(evaluation) > 0
    assert formats.detect_format(train.column_names) == "instruction"
    assert not set(train["instruction"]) & set(evaluation["instruction"])


def test_a_single_file_gets_a_held_out_split(tmp_path):
    file = tmp_path / "rows.jsonl"
    file.write_text("".join(f'{{"text": "row {i}"}}\n' for i in range(100)))
    train, evaluation = checked_rows.load_splits(str(file), seed=0)
    assert len(train) == 95 and len(evaluation) == 5


def test_chat_messages_train_on_assistant_turns_only(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort: 3 1 2"},
                {"role": "assistant", "content": "1 2 3"}, {"role": "user", "content": "Reverse: 1 2"},
                {"role": "assistant", "content": "2 1"}]
    assert formats.detect_format(["messages"]) == "messages"
    row = tokens.tokenize_row({"messages": messages}, tokenizer, "messages", 512)
    whole = tokenizer.decode(row["input_ids"])
    trained = tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != batches.IGNORE])
    assert "Be brief." in whole and "<|user|>" in whole  # the default template renders every turn
    assert trained.replace("\n", "") == f"1 2 3{tokenizer.eos_token}2 1{tokenizer.eos_token}"
    assert tokenizer.chat_template is None and formats.DEFAULT_CHAT_TEMPLATE


def test_columns_can_be_mapped_to_a_known_format(tmp_path):
    file = tmp_path / "qa.jsonl"
    file.write_text("".join(f'{{"question": "q{i}", "answer": "a{i}"}}\n' for i in range(40)))
    train, _ = checked_rows.load_splits(str(file), seed=0, columns="prompt=question,completion=answer")
    assert formats.detect_format(train.column_names) == "prompt_completion"
    with pytest.raises(Refusal, match=r"--columns names \['nope'\]"):
        checked_rows.load_splits(str(file), seed=0, columns="prompt=nope")


def test_packing_keeps_attention_inside_each_row(tokenizer):
    """A packed sequence computes, for every row in it, the logits of that row alone."""
    import datasets
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, use_cache=False).eval()  # as the recipes load it
    rows = [{"instruction": "Sort: 3 1 2", "response": "1 2 3"}, {"instruction": "Copy: 7 7", "response": "7 7"},
            {"instruction": "Reverse: 1 2 3 4", "response": "4 3 2 1"}]
    packed, _ = preparation.tokenize(datasets.Dataset.from_list(rows), tokenizer, max_length=512, packing=True)
    assert len(packed) == 1
    batch = batches.PadToLongest(tokenizer.pad_token_id)([packed[0]])
    assert "attention_mask" not in batch
    with torch.no_grad():
        packed_logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
        starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [batch["input_ids"].shape[1]]
        pieces = {tuple(batch["input_ids"][0, a:b].tolist()): (a, b) for a, b in zip(starts, starts[1:])}
        assert len(pieces) == len(rows)
        for row in rows:
            ids = tokens.tokenize_row(row, tokenizer, "instruction", 512)["input_ids"]
            start, end = pieces[tuple(ids)]  # best-fit packing orders rows by length, not as in the file
            alone = model(input_ids=torch.tensor([ids])).logits[0]
            assert torch.allclose(packed_logits[start:end], alone, atol=1e-5)


def test_packing_respects_max_length_and_keeps_every_target(tokenizer):
    train, _ = checked_rows.load_splits(None, seed=0)
    subset = train.select(range(200))
    plain, _ = preparation.tokenize(subset, tokenizer, max_length=128)
    packed, _ = preparation.tokenize(subset, tokenizer, max_length=128, packing=True)
    assert len(packed) < len(plain) / 3
    assert max(len(ids) for ids in packed["input_ids"]) <= 128
    count = lambda rows: sum(label != batches.IGNORE for labels in rows["labels"] for label in labels)  # noqa: E731
    assert count(packed) == count(plain)


def test_the_chat_template_travels_with_the_saved_tokenizer(tmp_path):
    """A tokenizer without a chat template gets the one chat rows are trained with, and keeps it when saved."""
    from transformers import AutoTokenizer

    from common.model import modeling

    tokenizer = modeling.load_tokenizer(str(TINY_MODEL))
    assert tokenizer.chat_template == formats.DEFAULT_CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    conversation = [{"role": "user", "content": "Sort: 2 1"}]
    text = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(conversation, tokenize=False,
                                                                      add_generation_prompt=True)
    assert text == "<s><|user|>\nSort: 2 1\n<|assistant|>\n"


def test_tokenised_rows_are_cached_by_rows_tokenizer_flags_and_code(tokenizer, tmp_path, monkeypatch):
    """A rerun with the same rows, tokenizer and --max-length reads the cached rows; a changed data
    path (its code) or --max-length tokenises again."""
    import datasets

    source = tmp_path / "rows.jsonl"
    source.write_text("".join(f'{{"prompt": "p{i}", "completion": "c{i}"}}\n' for i in range(30)))
    rows = datasets.load_dataset("json", data_files=str(source), split="train", cache_dir=str(tmp_path / "cache"))

    def cache_file(max_length=64):
        tokenized, _ = tokens.tokenize_counted(rows, tokenizer, max_length)
        return tokenized.cache_files[0]["filename"]

    first = cache_file()
    assert cache_file() == first and str(tmp_path / "cache") in first
    assert cache_file(128) != first
    monkeypatch.setattr(tokens, "data_path_code", lambda: "another version")
    assert cache_file() != first


def test_several_processes_tokenise_what_one_does(tokenizer, monkeypatch):
    """A large set is tokenised by a process per core; the rows come out the same and in order."""
    import datasets

    rows = datasets.Dataset.from_list([{"prompt": f"p{i} " * (i % 7), "completion": f"c{i}"} for i in range(60)])
    alone, _ = tokens.tokenize_counted(rows, tokenizer, 64)
    monkeypatch.setattr(tokens, "ROWS_PER_PROCESS", 20)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert tokens.preparing_processes(len(rows)) == 3 and tokens.preparing_processes(29) is None  # 29 rows: one process
    assert tokens.preparing_processes(31) == 2  # about ROWS_PER_PROCESS a process
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    together, _ = tokens.tokenize_counted(rows, tokenizer, 64)
    assert together.to_list() == alone.to_list()
    assert "TOKENIZERS_PARALLELISM" not in os.environ  # the next, smaller set has the tokenizer's threads
