"""scripts/inspect_data.py shows exactly what the recipes' data path trains on.

Run in-process (its `main`) on the bundled data and on a generated multi-turn chat file, with the
bundled tokenizer and the sentencepiece-style and byte-level fixture tokenizers: the JSON rows are
the recipes' own tokenisation (`preparation.tokenize` called directly), dropped rows carry their reason,
and the printed rows bracket exactly the trained tokens. One launch as a user types it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

import chat_fixtures as fixtures
from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
from common.data import batches, data_files, preparation  # noqa: E402
from common.model import modeling  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402

SCRIPT = REPO / "scripts" / "inspect_data.py"
# (fixture tokenizer, chat template family): None is the tokenizer's own (the bundled one has none,
# so the recipes' default); Qwen3's drops the multi-turn rows today, with its reason
TOKENIZERS = {"bundled": None, "sentencepiece": "llama3_1", "byte_level": "qwen3"}


def load_script():
    spec = importlib.util.spec_from_file_location("inspect_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


inspect_data = load_script()


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    """A folder holding just a tokenizer (and its chat template), for each fixture tokenizer."""
    folders = {}
    for name, family in TOKENIZERS.items():
        tok = fixtures.with_template(name, family) if family else fixtures.tokenizer(name)
        folder = tmp_path_factory.mktemp(f"model-{name}")
        tok.save_pretrained(folder)
        folders[name] = folder
    return folders


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    """Multi-turn chat rows, and two that no template can train: one without a reply, one with a role no
    template knows."""
    rows = fixtures.chat_rows(16, seed=11)
    rows.insert(3, {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]})
    rows.insert(9, {"messages": [{"role": "user", "content": "Weather?"}, {"role": "narrator", "content": "It rains."}]})
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def json_rows(capsys, *argv) -> list[dict]:
    assert inspect_data.main([*map(str, argv), "--json"]) == 0
    out = capsys.readouterr()
    assert out.err.strip().splitlines()[-1].startswith("data (")  # the recipes' data line, off stdout
    return [json.loads(line) for line in out.out.splitlines()]


def recipes_rows(dataset, folder, max_length: int) -> list[dict]:
    """What the recipes train on, split by split in file order: preparation.tokenize on the rows as read."""
    loaded, _ = data_files.read_splits(str(dataset) if dataset else None)
    tokenizer = modeling.load_tokenizer(str(folder))
    rows = []
    for name in sorted(loaded, key=lambda name: (name != "train", name)):
        kept, _ = preparation.tokenize(loaded[name], tokenizer, max_length)
        rows += [{"input_ids": row["input_ids"], "labels": row["labels"]} for row in kept]
    return rows


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_json_rows_of_the_bundled_data_are_what_the_recipes_train_on(name, model_folders, capsys):
    rows = json_rows(capsys, "--model", model_folders[name], "--max-length", 64)
    loaded, _ = data_files.read_splits(None)
    assert len(rows) == sum(len(split) for split in loaded.values())  # every row, none held out
    assert all(set(row) == {"input_ids", "labels", "dropped"} for row in rows)
    assert not [row for row in rows if row["dropped"]]
    assert rows == [{**row, "dropped": ""} for row in recipes_rows(None, model_folders[name], 64)]
    first = rows[0]
    tokenizer = modeling.load_tokenizer(str(model_folders[name]))
    targets = [token for token, label in zip(first["input_ids"], first["labels"]) if label != batches.IGNORE]
    assert tokenizer.decode(targets).strip() == f"2 6 8 9{tokenizer.eos_token}"  # data/train.jsonl's first response


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_json_rows_of_a_chat_file_are_what_the_recipes_train_on(name, model_folders, chat_file, capsys):
    rows = json_rows(capsys, "--model", model_folders[name], "--dataset", chat_file, "--max-length", 4096)
    assert len(rows) == 18
    kept = [row for row in rows if not row["dropped"]]
    assert kept == [{**row, "dropped": ""} for row in recipes_rows(chat_file, model_folders[name], 4096)]
    assert rows[3] == {"input_ids": [], "labels": [], "dropped": "no assistant reply"}
    assert rows[9]["input_ids"] == [] and rows[9]["dropped"].startswith("a role other than")
    for row in kept:
        assert len(row["input_ids"]) == len(row["labels"]) and any(label != batches.IGNORE for label in row["labels"])
    if name == "byte_level":  # Qwen3's template, which re-renders earlier replies: no row lost to it
        assert not [row for row in rows if row["dropped"].startswith("the chat template")]


def test_a_cut_row_and_a_row_too_long_are_shown_as_the_recipes_cut_them(model_folders, chat_file, capsys):
    rows = json_rows(capsys, "--model", model_folders["sentencepiece"], "--dataset", chat_file, "--max-length", 48)
    assert max(len(row["input_ids"]) for row in rows) == 48
    assert [row for row in rows if row["dropped"] == "too long for --max-length 48"]
    assert [row for row in rows if not row["dropped"]]


def test_printed_rows_bracket_the_trained_tokens_and_list_the_dropped(model_folders, chat_file, capsys):
    folder = model_folders["byte_level"]
    rows = json_rows(capsys, "--model", folder, "--dataset", chat_file, "--max-length", 4096)
    assert inspect_data.main(["--model", str(folder), "--dataset", str(chat_file), "--max-length", "4096",
                              "--rows", "100"]) == 0
    out = capsys.readouterr().out
    shown = out.split("--- dropped")[0].split("--- train row ")[1:]
    kept = [row for row in rows if not row["dropped"]]
    assert len(shown) == len(kept)
    tokenizer = modeling.load_tokenizer(str(folder))
    for text, row in zip(shown, kept):
        runs = sum(1 for i, label in enumerate(row["labels"])
                   if label != batches.IGNORE and (i == 0 or row["labels"][i - 1] == batches.IGNORE))
        assert text.count("[[") == text.count("]]") == runs
        trained = "".join(part.split("]]")[0] for part in text.split("[[")[1:])
        targets = [token for token, label in zip(row["input_ids"], row["labels"]) if label != batches.IGNORE]
        visible = trained.replace("·", "").replace("↵\n", "\n").replace("␣", " ")
        assert visible == tokenizer.decode(targets)
        assert "\x1b[" not in text  # no colour when stdout is not a terminal
    dropped = out.split("--- dropped")[1]
    assert "train row 4: no assistant reply" in dropped and "train row 10: a role other than" in dropped
    assert out.strip().splitlines()[-1].startswith("data (messages): train 18 rows: ")


def test_sentencepiece_word_starts_show_as_spaces(model_folders):
    tokenizer = modeling.load_tokenizer(str(model_folders["sentencepiece"]))
    ids = tokenizer("Here you go:\n\n5", add_special_tokens=False)["input_ids"]
    assert inspect_data.token_texts(tokenizer, ids)[1].startswith("␣")
    alone = tokenizer("Here", add_special_tokens=False)["input_ids"]
    assert inspect_data.token_texts(tokenizer, alone)[0].startswith("␣")  # "▁Here": what a reply tokenised alone gets


def test_a_missing_dataset_or_model_is_one_line(tmp_path, model_folders):
    with pytest.raises(Refusal, match=r"--dataset .*nope.jsonl does not exist"):
        inspect_data.main(["--model", str(model_folders["bundled"]), "--dataset", str(tmp_path / "nope.jsonl")])
    with pytest.raises(Refusal, match=r"--model .*no-model does not exist"):
        inspect_data.main(["--model", str(tmp_path / "no-model")])


def test_the_script_as_a_user_runs_it(model_folders, chat_file):
    result = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model_folders["sentencepiece"]),
                             "--dataset", str(chat_file), "--rows", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("--- train row 1: ") and "[[" in result.stdout
    assert lines[-1].startswith("data (messages): train 18 rows: 16 used, 2 dropped")
    # one file alone: what a recipe would hold out of it (5%, at least 1), as checked_rows.held_out holds it
    assert lines[-1].endswith("(a recipe given these alone holds out 1 row for evaluation and trains on the other "
                              "17; --eval-dataset names others)")
    missing = subprocess.run([sys.executable, str(SCRIPT), "--dataset", "missing.jsonl"], capture_output=True,
                             text=True, timeout=300)
    assert missing.returncode == 2
    assert missing.stderr.strip() == ("error: --dataset missing.jsonl does not exist; give a data file, a folder, "
                                      "or a hub id")
