"""Data as users have it: folders with notes beside the rows, dev / val splits, numbers in CSV
columns, tab-separated files, byte-order marks, ShareGPT and multi-part chat turns. Each either
trains on what the user meant or is refused in one line that names the fix."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO, TINY_MODEL

sys.path.insert(0, str(REPO / "recipes"))
from common.data import batches, checked_rows, data_files, formats, preparation, tokens  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402

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
    return tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != batches.IGNORE])


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
        checked_rows.load_splits(folder(tmp_path, files), seed=0)


@pytest.mark.parametrize("train_name, eval_name", [("train.jsonl", "dev.jsonl"), ("training.jsonl", "val.jsonl"),
                                                   ("train.jsonl", "validation-00000-of-00001.jsonl")])
def test_dev_and_val_files_are_the_evaluation_split(train_name, eval_name, tmp_path, capsys):
    held = [{"instruction": "held", "response": "out"}] * 3
    path = folder(tmp_path, {train_name: jsonl(ROWS), eval_name: jsonl(held), "notes.txt": "not data\n"})
    train, evaluation = checked_rows.load_splits(path, seed=0)
    assert (len(train), len(evaluation)) == (20, 3)
    said = capsys.readouterr().out
    assert f"files: train: {train_name}; validation: {eval_name}; not read: notes.txt" in said
    assert evaluation[0]["instruction"] == "held"


def test_names_that_only_start_like_a_split_are_not_splits(tmp_path):
    assert data_files.split_of(tmp_path / "values.jsonl") is None
    assert data_files.split_of(tmp_path / "devices.csv") is None
    assert data_files.split_of(tmp_path / "Train.JSONL") == "train"


def test_numbers_in_a_csv_answer_column_are_text(tmp_path, tokenizer):
    path = tmp_path / "numeric.CSV"
    path.write_text("question,answer\n" + "".join(f"What is {i}+0?,{i}\n" for i in range(20)))
    train, evaluation = checked_rows.load_splits(str(path), seed=0, columns="instruction=question,response=answer")
    tokenized, fmt = preparation.tokenize(train, tokenizer, 64)
    assert fmt == "instruction" and len(tokenized) == len(train) == 19  # nothing dropped as "empty target"
    row = next(row for row in train if row["instruction"] == "What is 7+0?")
    assert row["response"] == "7"


def test_tab_separated_files_load(tmp_path):
    path = tmp_path / "data.tsv"
    path.write_text("instruction\tresponse\n" + "".join(f"Say {i}, please\tok {i}\n" for i in range(20)))
    train, _ = checked_rows.load_splits(str(path), seed=0)
    assert set(train.column_names) == {"instruction", "response"} and "," in train[0]["instruction"]


def test_a_byte_order_mark_and_line_separators_inside_strings_are_fine(tmp_path):
    rows = [{"instruction": f"Say {i}", "response": f"ok {i}\u2028done"} for i in range(20)]
    path = tmp_path / "data.jsonl"
    path.write_bytes("\ufeff".encode() + jsonl(rows).encode())
    train, evaluation = checked_rows.load_splits(str(path), seed=0)
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
        checked_rows.load_splits(str(path), seed=0)


def test_a_json_lines_file_of_one_chat_row_is_a_row(tmp_path):
    """One line of JSON Lines is a row, lists in it or not (it is no object of columns)."""
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"messages": turns}) + "\n")
    assert data_files.check_files([path], None) == {path: ["messages"]}
    loaded, _ = data_files.read_splits(str(path))
    assert len(loaded["train"]) == 1


@pytest.mark.parametrize("columns, message", [
    ("text=answer", "which --dataset already has"),
    ("instruction=question,instruction=answer", "more than one column onto instruction"),
])
def test_columns_that_collide_are_refused(columns, message, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(jsonl({"text": f"Q {i}", "answer": f"A {i}", "question": f"q {i}"} for i in range(20)))
    with pytest.raises(Refusal, match=message):
        checked_rows.load_splits(str(path), seed=0, columns=columns)


def test_sharegpt_conversations_train_on_the_replies(tmp_path, tokenizer):
    rows = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": f"hi {i}"},
                               {"from": "gpt", "value": f"yo {i}"}]} for i in range(20)]
    path = tmp_path / "sharegpt.jsonl"
    path.write_text(jsonl(rows))
    train, _ = checked_rows.load_splits(str(path), seed=0)
    tokenized, fmt = preparation.tokenize(train, tokenizer, 128)
    assert fmt == "messages" and len(tokenized) == len(train)
    reply = train[0]["messages"][-1]["value"]
    assert targets_of(tokenized[0], tokenizer).startswith(reply + tokenizer.eos_token)


def test_content_parts_capitalised_roles_and_an_opening_greeting(tokenizer):
    turns = [{"role": "Assistant", "content": [{"type": "text", "text": "Hello!"}]},
             {"role": "User", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": "x"}]},
             {"role": "Assistant", "content": [{"type": "text", "text": "yo"}]}]
    assert formats.row_problem({"messages": turns}, "messages") is None
    row = tokens.tokenize_row({"messages": json.dumps(turns)}, tokenizer, "messages", 128)  # a JSON string too
    assert targets_of(row, tokenizer).strip() == "yo" + tokenizer.eos_token  # the greeting is context, not a target
    assert formats.row_problem({"messages": turns[:2]}, "messages") == "no assistant reply"


def test_too_few_rows_for_the_processes_names_every_fix():
    with pytest.raises(Refusal, match="or give more rows \\(or launch fewer processes\\)"):
        batches.steps_per_epoch(0, 1)


def test_the_held_out_rows_are_rows_that_can_train(tmp_path):
    rows = [{"instruction": f"Say {i}", "response": "" if i % 3 else f"ok {i}"} for i in range(40)]
    path = tmp_path / "sparse.jsonl"
    path.write_text(jsonl(rows))
    train, evaluation = checked_rows.load_splits(str(path), seed=0)
    assert len(train) + len(evaluation) == 40 and len(evaluation) == 2
    assert all(formats.row_problem(row, "instruction") is None for row in evaluation)
    assert sum(formats.row_problem(row, "instruction") is not None for row in train) == 26  # kept, to be counted


# What users' files hold beyond the happy path: each trains on what was meant, or one line names the fix

RAISES_ON_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                    "{{ raise_exception('System role not supported') }}{% endif %}"
                    "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")


def test_a_row_the_chat_template_refuses_is_dropped_and_counted(tokenizer):
    import copy

    import datasets

    strict = copy.deepcopy(tokenizer)
    strict.chat_template = RAISES_ON_SYSTEM
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rows = [{"messages": chat}] * 3 + [{"messages": [{"role": "system", "content": "Be brief."}, *chat]}]
    tokenized, _ = tokens.tokenize_counted(datasets.Dataset.from_list(rows), strict, 64)
    assert tokens.counted(tokenized) == ("4 rows: 3 used, 1 dropped (the chat template refuses it: System role "
                                       "not supported: 1); EOS added after 3 replies (the chat template ends them "
                                       "with no special token)")


def test_weight_zero_turns_are_context_and_developer_is_the_system_role(tokenizer):
    turns = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "q"},
             {"role": "assistant", "content": "BAD", "weight": 0}, {"role": "user", "content": "again"},
             {"role": "assistant", "content": "good", "weight": 1}]
    assert formats.row_problem({"messages": turns}, "messages") is None
    row = tokens.tokenize_row({"messages": turns}, tokenizer, "messages", 256)
    assert "BAD" not in targets_of(row, tokenizer) and targets_of(row, tokenizer).startswith("good")
    assert "<|system|>" in tokenizer.decode(row["input_ids"]) or "system" in tokenizer.decode(row["input_ids"])
    only_weightless = [turns[1], turns[2]]
    assert formats.row_problem({"messages": only_weightless}, "messages") == "no assistant reply"


def test_rows_cut_to_max_length_are_counted(tokenizer):
    import datasets

    rows = [{"instruction": "Count.", "response": " ".join(str(i) for i in range(200))}, ROWS[0]]
    tokenized, _ = tokens.tokenize_counted(datasets.Dataset.from_list(rows), tokenizer, 64)
    assert tokens.counted(tokenized) == "2 rows: 2 used (1 of them cut to --max-length)"
    assert len(tokenized[0]["input_ids"]) == 64 and tokenized["cut"] == [True, False]


def test_csv_cells_are_read_as_written(tmp_path):
    answers = ["1.50", "007", "1e3", "02134", "NA", "None", "null", "N/A", "3.10", "5"]
    path = tmp_path / "answers.csv"
    # 12,000 rows that look like numbers, then text: pandas guesses each 10,000-row chunk's types apart
    rows = [(f"q{i}", answers[i % 10]) for i in range(12_000)] + [(f"t{i}", f"answer {i}") for i in range(20)]
    path.write_text("instruction,output\n" + "".join(f"{q},{a}\n" for q, a in rows))
    train, evaluation = checked_rows.load_splits(str(path), seed=0)
    written = {row["instruction"]: row["output"] for split in (train, evaluation) for row in split}
    assert [written[f"q{i}"] for i in range(10)] == answers and written["t3"] == "answer 3"


def test_columns_the_format_does_not_read_are_named(tmp_path):
    rows = [{"instruction": "Summarise.", "context": f"Passage {i}", "response": f"r {i}", "category": "qa"}
            for i in range(20)]
    train, _ = checked_rows.load_splits(folder(tmp_path, {"dolly.jsonl": jsonl(rows)}), seed=0)
    assert formats.unread_columns(train.column_names, "instruction") == (
        "; columns not read: category, context (--columns input=context reads `context` as the input)")
    assert formats.unread_columns(["text"], "text") == ""


def test_rows_of_two_formats_are_refused_naming_the_first_other_row(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}] * 5
    path = tmp_path / "mixed.jsonl"
    path.write_text(jsonl(rows + [{"text": "plain"}] * 5))
    with pytest.raises(Refusal, match=r"mixes formats: its rows are `messages` rows \(messages\), but row 6 "
                                      r"has `text` and no `messages`"):
        checked_rows.load_splits(str(path), seed=0)
    path.write_text(jsonl({"text": f"t {i}", "messages": None} for i in range(20)))  # an empty column is no format
    train, _ = checked_rows.load_splits(str(path), seed=0)
    assert formats.filled_columns(train) == ["text"] and checked_rows.format_of(train, str(path)) == "text"


def test_a_text_file_byte_order_mark_is_not_text(tmp_path, tokenizer):
    path = tmp_path / "notes.txt"
    path.write_bytes("\ufeff".encode() + b"".join(f"line {i}\n".encode() for i in range(20)))
    train, evaluation = checked_rows.load_splits(str(path), seed=0)
    assert not any(row["text"].startswith("\ufeff") for split in (train, evaluation) for row in split)


@pytest.mark.parametrize("text", [json.dumps(ROWS), json.dumps(ROWS, indent=2)])
def test_a_json_array_named_jsonl_loads(text, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(text)
    train, evaluation = checked_rows.load_splits(str(path), seed=0)
    assert len(train) + len(evaluation) == 20


@pytest.mark.parametrize("name, text, message", [
    ("pretty.jsonl", "".join(json.dumps(row, indent=2) + "\n" for row in ROWS), "is pretty-printed JSON"),
    ("twice.jsonl", jsonl(ROWS) + '{"instruction": "q", "output": "a", "output": "b"}\n',
     r"twice.jsonl:21: `output` appears twice in one row; keep one"),
    ("rows.json", json.dumps(ROWS + [{"instruction": "q", "output": ["a"]}]), r"rows.json: row 21: `output` must be text"),
    ("rows.json", json.dumps(ROWS + ["a row"]), r"rows.json: row 21: a row must be a JSON object"),
    ("bad.csv", "instruction,output\nq1,a1\nq2,a2,extra\n", "Expected 2 fields in line 3, saw 3"),
    ("semi.csv", "instruction;output\nq1;a1\nq2;a2\n", "separates its columns with `;`"),
    ("header.csv", "instruction,output\n", "has a header line but no rows"),
])
def test_a_file_that_cannot_be_read_names_the_line_or_the_layout(name, text, message, tmp_path):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(Refusal, match=message):
        checked_rows.load_splits(str(path), seed=0)


def test_gzip_files_get_the_same_line_checks(tmp_path):
    import gzip

    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(gzip.compress((jsonl(ROWS) + "{not json}\n").encode()))
    with pytest.raises(Refusal, match=r"rows.jsonl.gz:21: not valid JSON"):
        checked_rows.load_splits(str(path), seed=0)
    path.write_bytes(gzip.compress(jsonl(ROWS).encode()))
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "train.jsonl.gz").write_bytes(path.read_bytes())
    train, evaluation = checked_rows.load_splits(str(tmp_path / "inner"), seed=0)
    assert len(train) + len(evaluation) == 20


def test_a_parquet_column_that_is_not_text_is_named(tmp_path):
    import datasets

    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list([{"instruction": r["instruction"], "output": [r["response"]]} for r in ROWS]).to_parquet(path)
    with pytest.raises(Refusal, match=r"column `output` holds list values, not text"):
        checked_rows.load_splits(str(path), seed=0)


def test_save_to_disk_folders_load(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).save_to_disk(tmp_path / "one")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[:3])}).save_to_disk(tmp_path / "two")
    train, evaluation = checked_rows.load_splits(str(tmp_path / "one"), seed=0)
    assert len(train) + len(evaluation) == 20
    train, evaluation = checked_rows.load_splits(str(tmp_path / "two"), seed=0)
    assert (len(train), len(evaluation)) == (20, 3)


def test_a_folder_with_a_config_beside_the_rows_or_the_rows_one_level_down(tmp_path):
    (tmp_path / "a").mkdir()
    folder(tmp_path / "a", {"train.jsonl": jsonl(ROWS), "train_config.json": json.dumps({"lr": 0.1})})
    with pytest.raises(Refusal, match=r"train.jsonl and train_config.json are both read as the train split"):
        checked_rows.load_splits(str(tmp_path / "a"), seed=0)
    (tmp_path / "b" / "data").mkdir(parents=True)
    folder(tmp_path / "b" / "data", {"train.jsonl": jsonl(ROWS)})
    (tmp_path / "b" / "other").mkdir()
    folder(tmp_path / "b" / "other", {"train.jsonl": jsonl(ROWS)})
    with pytest.raises(Refusal, match=r"its folders data/, other/ do: point --dataset at the one to train on, e.g. .*b/data"):
        checked_rows.load_splits(str(tmp_path / "b"), seed=0)


def test_a_hub_dataset_as_downloaded_is_read_from_its_data_folder(tmp_path, capsys):
    """`huggingface-cli download --repo-type dataset ORG/NAME --local-dir d`: README.md beside data/,
    which holds the sharded split files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    (tmp_path / "README.md").write_text("---\nconfigs:\n- config_name: default\n---\n# A dataset\n")
    (tmp_path / ".gitattributes").write_text("*.parquet filter=lfs\n")
    for name, rows in (("train-00000-of-00002", ROWS[:12]), ("train-00001-of-00002", ROWS[12:]),
                       ("test-00000-of-00001", ROWS[:4])):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data" / f"{name}.parquet")
    train, evaluation = checked_rows.load_splits(str(tmp_path), seed=0)
    assert (len(train), len(evaluation)) == (len(ROWS), 4)
    assert "files: train: data/train-00000-of-00002.parquet, data/train-00001-of-00002.parquet; test: " \
           "data/test-00000-of-00001.parquet" in capsys.readouterr().out


def test_a_home_folder_path_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "rows.jsonl").write_text(jsonl(ROWS))
    train, evaluation = checked_rows.load_splits("~/rows.jsonl", seed=0)
    assert len(train) + len(evaluation) == 20


def test_an_eval_dataset_is_the_evaluation_and_every_training_row_trains(tmp_path):
    train_file, eval_file = tmp_path / "train.jsonl", tmp_path / "held.csv"
    train_file.write_text("".join(f'{{"prompt": "p{i}", "completion": "c{i}"}}\n' for i in range(40)))
    eval_file.write_text("prompt,completion\n" + "".join(f"q{i},d{i}\n" for i in range(7)))
    train, evaluation = checked_rows.load_splits(str(train_file), 0, None, str(eval_file))
    assert len(train) == 40 and evaluation["prompt"] == [f"q{i}" for i in range(7)]
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "plain"}\n')
    with pytest.raises(Refusal, match=r"^--eval-dataset .*other.jsonl holds text rows, --dataset .* prompt_completion rows"):
        checked_rows.load_splits(str(train_file), 0, None, str(other))


def test_trl_conversational_prompt_completion_rows_train_on_the_completion(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Sort {i} 1"},
                        {"role": "assistant", "content": "Earlier answer."}, {"role": "user", "content": "Again?"}],
             "completion": [{"role": "assistant", "content": f"1 {i}"}]} for i in range(2, 30)]
    file = tmp_path / "pc.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    train, evaluation = checked_rows.load_splits(str(file), 0)
    assert formats.detect_format(train.column_names) == "messages" and len(train) + len(evaluation) == len(rows)
    tokenized, _ = tokens.tokenize_counted(train, tokenizer, 512)
    for row in tokenized:
        trained = tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != batches.IGNORE])
        assert trained.startswith("1 ") and "Earlier answer." not in trained and "Sort" not in trained


def test_a_file_checked_before_is_not_read_again_until_it_changes(tmp_path, monkeypatch):
    """A rerun of a large dataset skips the line-by-line check of files it checked unchanged; a file
    edited since (even to the same size, at once) is checked again."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "ab"}\n')
    assert data_files.check_files([path], None) == {path: ["text"]}
    read = []
    monkeypatch.setattr(data_files, "check_file", lambda *given: read.append(given) or ["text"])
    assert data_files.check_files([path], None) == {path: ["text"]} and not read
    monkeypatch.undo()
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path.write_text('{"text": 12}\n')  # the same size, within the same clock tick
    with pytest.raises(Refusal, match=r"rows.jsonl:1: `text` must be text \(or null\), got 12"):
        data_files.check_files([path], None)
