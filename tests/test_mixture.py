"""Several datasets in one run: `--dataset SPEC[:WEIGHT]` given more than once (or a `dataset:` list in
the run file): the weights, the draw (the same for the same seed, on every rank and resume), each
source's own held-out rows, the data lines, the refusals, and one launch of a mixture of an
instruction file and a chat file under DDP."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import chat_fixtures as fixtures
from conftest import REPO, assert_no_traceback_of_ours, launch

sys.path.insert(0, str(REPO / "recipes"))
from common.data import checked_rows, mixture  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.refusal import Refusal  # noqa: E402


def jsonl(path, rows: list[dict]):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def instruction_rows(count: int) -> list[dict]:
    return [{"instruction": f"Add {i} and 1", "response": str(i + 1)} for i in range(count)]


def test_a_weight_follows_the_last_colon():
    assert mixture.sources_of(["a.jsonl:0.7", "org/name:2", "b.jsonl"]) == [
        mixture.Source("a.jsonl", 0.7), mixture.Source("org/name", 2.0), mixture.Source("b.jsonl", 1.0)]
    assert mixture.sources_of(None) == [mixture.Source(None)]
    assert mixture.sources_of("one.jsonl") == [mixture.Source("one.jsonl")]
    assert mixture.source_of("org/name:config") == mixture.Source("org/name:config")  # no number: no weight


def test_a_file_whose_name_has_a_colon_is_a_file(tmp_path):
    file = jsonl(tmp_path / "rows:2", instruction_rows(4))
    assert mixture.source_of(str(file)) == mixture.Source(str(file))


@pytest.mark.parametrize("given, says", [
    (["a.jsonl:0"], "the weight must be a number above 0"),
    (["a.jsonl:-1"], "the weight must be a number above 0"),
    ([":0.5"], "names no dataset before its weight"),
    (["a.jsonl", "a.jsonl:2"], "--dataset a.jsonl is given more than once"),
])
def test_a_weight_that_cannot_work_is_refused(given, says):
    with pytest.raises(Refusal, match=says):
        mixture.sources_of(given)


def test_the_draw_is_the_seeds_and_the_sources_place():
    import datasets

    rows = datasets.Dataset.from_list(instruction_rows(100))
    texts = list(rows["instruction"])

    def drawn(weight: float, position: int = 0, seed: int = 1) -> list[str]:
        return list(mixture.draw(rows, mixture.Source("a", weight), position, seed)["instruction"])

    half = drawn(0.5)
    assert len(half) == 50 and len(set(half)) == 50 and set(half) < set(texts)
    assert half == drawn(0.5) and half != drawn(0.5, seed=2) and half != drawn(0.5, position=1)
    assert sorted(drawn(2)) == sorted(texts * 2)
    counts = [drawn(1.5).count(text) for text in texts]
    assert counts.count(2) == 50 and counts.count(1) == 50
    assert mixture.draw(rows, mixture.Source("a"), 0, 1) is rows
    with pytest.raises(Refusal, match="draws none of its 100 usable rows; give it a larger weight"):
        drawn(0.001)


def test_the_draw_is_the_same_in_another_process():
    """Every rank draws for itself: a process with another hash seed draws the same rows."""
    code = ("import sys; sys.path.insert(0, 'recipes'); import datasets; from common.data import mixture; "
            "rows = datasets.Dataset.from_dict({'i': list(range(1000))}); "
            "print(list(mixture.draw(rows, mixture.Source('a', 0.3), 2, seed=7)['i']))")
    drawn = [subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                            env={"PYTHONHASHSEED": str(hash_seed), "PATH": ""}).stdout for hash_seed in (1, 2)]
    assert drawn[0] == drawn[1] and len(json.loads(drawn[0])) == 300


def test_each_source_holds_out_its_own_rows(tmp_path):
    chats = jsonl(tmp_path / "chats.jsonl", fixtures.chat_rows(60, seed=3))
    folder = tmp_path / "qa"
    folder.mkdir()
    jsonl(folder / "train.jsonl", instruction_rows(40))
    jsonl(folder / "validation.jsonl", instruction_rows(3))
    train, evaluation = checked_rows.load_sources([f"{chats}:0.5", f"{folder}:2"], seed=0)
    assert [(part.name, part.fmt, len(part.rows)) for part in train] == [(str(chats), "messages", 57),
                                                                         (str(folder), "instruction", 40)]
    assert [(part.fmt, len(part.rows)) for part in evaluation] == [("messages", 3), ("instruction", 3)]
    assert [part.source.weight for part in train] == [0.5, 2.0] and train[0].source is evaluation[0].source
    held = {json.dumps(row) for row in evaluation[0].rows}
    assert len(held) == 3 and not held & {json.dumps(row) for row in train[0].rows}


def test_an_eval_dataset_replaces_every_sources_held_out_rows(tmp_path):
    chats = jsonl(tmp_path / "chats.jsonl", fixtures.chat_rows(30, seed=3))
    answers = jsonl(tmp_path / "qa.jsonl", instruction_rows(20))
    held = jsonl(tmp_path / "held.jsonl", instruction_rows(5))
    train, evaluation = checked_rows.load_sources([str(chats), str(answers)], 0, eval_spec=str(held))
    assert [len(part.rows) for part in train] == [30, 20] and [len(part.rows) for part in evaluation] == [5]
    texts = jsonl(tmp_path / "texts.jsonl", [{"text": "hello"}] * 4)
    with pytest.raises(Refusal, match="holds text rows, the --dataset sources instruction and messages rows; give both in one"):
        checked_rows.load_sources([str(chats), str(answers)], 0, eval_spec=str(texts))


def test_a_run_file_gives_a_list_and_a_typed_flag_replaces_it(tmp_path):
    run_file = tmp_path / "run.yaml"
    run_file.write_text("dataset:\n  - a.jsonl:0.7\n  - org/name\n")
    args = parse_args(recipe_flags("lora"), ["--config", str(run_file)])
    assert args.dataset == ["a.jsonl:0.7", "org/name"] and "dataset" in args.given_flags
    args = parse_args(recipe_flags("lora"), ["--config", str(run_file), "--dataset", "b.jsonl"])
    assert args.dataset == ["b.jsonl"]
    run_file.write_text("dataset: a.jsonl\n")
    assert parse_args(recipe_flags("lora"), ["--config", str(run_file)]).dataset == ["a.jsonl"]
    run_file.write_text("dataset:\n  - {path: a.jsonl}\n")
    with pytest.raises(Refusal, match="must be text; write it as you would type the flag"):
        parse_args(recipe_flags("lora"), ["--config", str(run_file)])


def test_a_launch_trains_on_a_mixture_of_formats_and_layouts(tmp_path):
    """Under DDP, from the run file: an instruction file at half its rows, a chat dataset as the hub's
    download leaves it (README.md beside data/*.parquet) twice over, and TRL's conversational
    prompt-completion rows once. The data lines count each source; the run records both formats."""
    import datasets

    answers = jsonl(tmp_path / "qa.jsonl", instruction_rows(80))  # 4 held out, 76 train, 38 drawn
    hub = tmp_path / "org--chats"  # 2 held out, 38 train, 76 drawn
    (hub / "data").mkdir(parents=True)
    (hub / "README.md").write_text("---\nlicense: mit\n---\n")
    datasets.Dataset.from_list(fixtures.chat_rows(40, seed=5)).to_parquet(hub / "data" / "train-00000-of-00001.parquet")
    turns = [row["messages"] for row in fixtures.chat_rows(20, seed=6)]  # 1 held out, 19 train
    completions = jsonl(tmp_path / "prompt_completion.jsonl",
                        [{"prompt": messages[:-1], "completion": messages[-1:]} for messages in turns])
    run_file = tmp_path / "run.yaml"
    run_file.write_text(f"dataset:\n  - {answers}:0.5\n  - {hub}:2\n  - {completions}\n")
    run = launch("lora", tmp_path / "out", "--config", str(run_file), "--max-steps", "2", "--batch-size", "2",
                 config="ddp")
    assert run.returncode == 0, run.output[-3000:]
    assert_no_traceback_of_ours(run.output)
    lines = [line for line in run.output.splitlines() if line.startswith("data: ")]
    assert lines[0].startswith(f"data: {answers} (instruction): training 76 rows: 76 used; "
                               "drawn: 38 rows (weight 0.5); evaluation 4 rows: 4 used"), lines
    assert lines[1].startswith(f"data: {hub} (messages): training 38 rows: 38 used; "), lines
    assert "drawn: 76 rows (weight 2); evaluation 2 rows: 2 used" in lines[1], lines
    assert lines[2].startswith(f"data: {completions} (messages): training 19 rows: 19 used; "), lines
    assert "drawn: 19 rows (weight 1); evaluation 1 row: 1 used" in lines[2], lines
    assert lines[3] == (f"data: 3 sources: 133 training rows ({answers} 29%, {hub} 57%, {completions} 14%), "
                        "7 evaluation rows")
    assert lines[4].startswith("data: chat rows rendered with the plain default")  # the template the chat rows took
    assert len(lines) == 5  # rank 0 only
    assert run.run_json()["data_format"] == "instruction+messages"


def test_a_missing_source_is_refused_before_the_model_loads(tmp_path):
    answers = jsonl(tmp_path / "qa.jsonl", instruction_rows(20))
    run = launch("lora", tmp_path / "out", "--dataset", str(answers), "--dataset", str(tmp_path / "nope.jsonl:0.5"),
                 "--max-steps", "1")
    assert run.returncode != 0
    [line] = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: --dataset {tmp_path / 'nope.jsonl'} does not exist"), line
    assert "model: loading the weights" not in run.output
