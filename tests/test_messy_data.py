"""Data as users have it: folders with notes beside the rows, dev / val splits, numbers in CSV
columns, tab-separated files, byte-order marks, ShareGPT and multi-part chat turns. Each either
trains on what the user meant or is refused in one line that names the fix."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO, TINY_MODEL

sys.path.insert(0, str(REPO / "recipes"))
from common import data  # noqa: E402
from common.preflight import Refusal  # noqa: E402

ROWS = [{"instruction": f"Say {i}", "response": f"ok {i}"} for i in range(20)]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_MODEL)


def jsonl(rows) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def folder(tmp_path, files: dict):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return str(tmp_path)


def targets_of(row: dict, tokenizer) -> str:
    return tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != data.IGNORE])


@pytest.mark.parametrize("files, message", [
    ({"train.jsonl": jsonl(ROWS), "eval_notes.txt": "eval was done by hand\n"}, "mixes file formats"),
    ({"data.jsonl": jsonl(ROWS), "README.txt": "where the rows came from\n"}, "mixes file formats"),
    ({"eval.jsonl": jsonl(ROWS)}, "but no train\\* file"),
    ({"train.jsonl": jsonl(ROWS), "eval.jsonl": ""}, "eval.jsonl is empty"),
    ({"train.jsonl": jsonl(ROWS), "eval.jsonl": "  \n"}, "eval.jsonl is empty"),
    ({"train.jsonl": jsonl(ROWS), "eval.jsonl": jsonl([{"instruction": "a", "output": "b"}] * 3)},
     "the splits have different columns"),
])
def test_a_folder_that_cannot_mean_one_thing_is_refused(files, message, tmp_path):
    with pytest.raises(Refusal, match=message):
        data.load_splits(folder(tmp_path, files), seed=0)


@pytest.mark.parametrize("train_name, eval_name", [("train.jsonl", "dev.jsonl"), ("training.jsonl", "val.jsonl"),
                                                   ("train.jsonl", "validation-00000-of-00001.jsonl")])
def test_dev_and_val_files_are_the_evaluation_split(train_name, eval_name, tmp_path, capsys):
    held = [{"instruction": "held", "response": "out"}] * 3
    path = folder(tmp_path, {train_name: jsonl(ROWS), eval_name: jsonl(held), "notes.txt": "not data\n"})
    train, evaluation = data.load_splits(path, seed=0)
    assert (len(train), len(evaluation)) == (20, 3)
    said = capsys.readouterr().out
    assert f"files: train: {train_name}; validation: {eval_name}; not read: notes.txt" in said
    assert evaluation[0]["instruction"] == "held"


def test_names_that_only_start_like_a_split_are_not_splits(tmp_path):
    assert data.split_of(tmp_path / "values.jsonl") is None
    assert data.split_of(tmp_path / "devices.csv") is None
    assert data.split_of(tmp_path / "Train.JSONL") == "train"


def test_numbers_in_a_csv_answer_column_are_text(tmp_path, tokenizer):
    path = tmp_path / "numeric.CSV"
    path.write_text("question,answer\n" + "".join(f"What is {i}+0?,{i}\n" for i in range(20)))
    train, evaluation = data.load_splits(str(path), seed=0, columns="instruction=question,response=answer")
    tokenized, fmt = data.tokenize(train, tokenizer, 64)
    assert fmt == "instruction" and len(tokenized) == len(train) == 19  # nothing dropped as "empty target"
    row = next(row for row in train if row["instruction"] == "What is 7+0?")
    assert row["response"] == "7"


def test_tab_separated_files_load(tmp_path):
    path = tmp_path / "data.tsv"
    path.write_text("instruction\tresponse\n" + "".join(f"Say {i}, please\tok {i}\n" for i in range(20)))
    train, _ = data.load_splits(str(path), seed=0)
    assert set(train.column_names) == {"instruction", "response"} and "," in train[0]["instruction"]


def test_a_byte_order_mark_and_line_separators_inside_strings_are_fine(tmp_path):
    rows = [{"instruction": f"Say {i}", "response": f"ok {i}\u2028done"} for i in range(20)]
    path = tmp_path / "data.jsonl"
    path.write_bytes("\ufeff".encode() + jsonl(rows).encode())
    train, evaluation = data.load_splits(str(path), seed=0)
    assert len(train) + len(evaluation) == 20
    assert all(row["response"].endswith("\u2028done") for row in train)


@pytest.mark.parametrize("document, message", [
    ({"instruction": ["a", "b"], "response": ["c", "d"]}, "one JSON object of lists, not rows"),
    ({"version": 1, "data": ROWS}, "one JSON object of lists, not rows"),
])
def test_a_json_object_instead_of_rows_names_the_layout(document, message, tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(document))
    with pytest.raises(Refusal, match=message):
        data.load_splits(str(path), seed=0)


@pytest.mark.parametrize("columns, message", [
    ("text=answer", "which --dataset already has"),
    ("instruction=question,instruction=answer", "more than one column onto instruction"),
])
def test_columns_that_collide_are_refused(columns, message, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(jsonl({"text": f"Q {i}", "answer": f"A {i}", "question": f"q {i}"} for i in range(20)))
    with pytest.raises(Refusal, match=message):
        data.load_splits(str(path), seed=0, columns=columns)


def test_sharegpt_conversations_train_on_the_replies(tmp_path, tokenizer):
    rows = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": f"hi {i}"},
                               {"from": "gpt", "value": f"yo {i}"}]} for i in range(20)]
    path = tmp_path / "sharegpt.jsonl"
    path.write_text(jsonl(rows))
    train, _ = data.load_splits(str(path), seed=0)
    tokenized, fmt = data.tokenize(train, tokenizer, 128)
    assert fmt == "messages" and len(tokenized) == len(train)
    reply = train[0]["messages"][-1]["value"]
    assert targets_of(tokenized[0], tokenizer).startswith(reply + tokenizer.eos_token)


def test_content_parts_capitalised_roles_and_an_opening_greeting(tokenizer):
    turns = [{"role": "Assistant", "content": [{"type": "text", "text": "Hello!"}]},
             {"role": "User", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": "x"}]},
             {"role": "Assistant", "content": [{"type": "text", "text": "yo"}]}]
    assert data.row_problem({"messages": turns}, "messages") is None
    row = data.tokenize_row({"messages": json.dumps(turns)}, tokenizer, "messages", 128)  # a JSON string too
    assert targets_of(row, tokenizer).strip() == "yo" + tokenizer.eos_token  # the greeting is context, not a target
    assert data.row_problem({"messages": turns[:2]}, "messages") == "no assistant reply"


def test_too_few_rows_for_the_processes_names_every_fix():
    with pytest.raises(Refusal, match="or give more rows \\(or launch fewer processes\\)"):
        data.steps_per_epoch(0, 1)


def test_the_held_out_rows_are_rows_that_can_train(tmp_path):
    rows = [{"instruction": f"Say {i}", "response": "" if i % 3 else f"ok {i}"} for i in range(40)]
    path = tmp_path / "sparse.jsonl"
    path.write_text(jsonl(rows))
    train, evaluation = data.load_splits(str(path), seed=0)
    assert len(train) + len(evaluation) == 40 and len(evaluation) == 2
    assert all(data.row_problem(row, "instruction") is None for row in evaluation)
    assert sum(data.row_problem(row, "instruction") is not None for row in train) == 26  # kept, to be counted
