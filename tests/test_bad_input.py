"""Bad input is one line naming the fix, before the model loads; rows that cannot train are counted.

Each case in-process (the checks the recipes run); test_interruptions.py and the randomized launch
test at the end take them through the real `accelerate launch`.
"""

from __future__ import annotations

import json
import os
import random
import sys
from unittest import mock

import pytest

from conftest import REPO, TINY_MODEL, assert_no_traceback_of_ours, assert_the_refusal_ends_the_output, launch, long_test

sys.path.insert(0, str(REPO / "recipes"))
from common.data import checked_rows, tokens  # noqa: E402
from common.launching import preflight, quick_checks, settle  # noqa: E402
from common.outputs import checkpoint  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.launching.launch import Launch  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402


@pytest.fixture(autouse=True)
def restored_environment():
    with mock.patch.dict(os.environ):
        yield


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_MODEL)


def args_of(*argv: str, recipe: str = "lora"):
    return parse_args(recipe_flags(recipe), list(argv))


def write_lines(path, lines: list) -> str:
    path.write_bytes(b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n"
                              for line in lines))
    return str(path)


GOOD = {"instruction": "Sort: 3 1 2", "response": "1 2 3"}


# Files that cannot be read: the first bad line, as file:line

@pytest.mark.parametrize("bad, message", [
    (b'{"instruction": "Sort: 1", "response": "1"', r":3: not valid JSON \(Expecting ',' delimiter, column 43\)"),
    (b'{"instruction": "caf\xe9", "response": "x"}', r":3: not UTF-8 \(byte 0xe9\); save the file as UTF-8"),
    (b'["a", "b"]', r":3: a row must be a JSON object"),
    (b'{"instruction": "Sort: 1", "response": 42}', r":3: `response` must be text \(or null\), got 42"),
])
def test_a_file_that_cannot_be_read_names_its_line(bad, message, tmp_path):
    path = write_lines(tmp_path / "rows.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(Refusal, match=f"^{path}{message}"):
        checked_rows.load_splits(path, seed=0)


def test_columns_are_checked_under_their_mapped_names(tmp_path):
    path = write_lines(tmp_path / "rows.jsonl", [{"question": "q", "answer": "a"}, {"question": "q", "answer": 7}])
    with pytest.raises(Refusal, match=r":2: `answer` must be text"):
        checked_rows.load_splits(path, seed=0, columns="instruction=question,response=answer")


# Rows that cannot train: dropped and counted; none left is one line with the fix

def tokenized(tokenizer, rows, max_length=512):
    import datasets

    return tokens.tokenize_counted(datasets.Dataset.from_list(rows), tokenizer, max_length)[0]


def test_rows_that_cannot_train_are_counted(tokenizer):
    chats = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
             {"messages": [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "{}"}]},
             {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}]},
             {"messages": [{"role": "user", "content": "hi"}]},
             {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]}]
    assert tokens.counted(tokenized(tokenizer, chats)) == (
        "5 rows: 1 used, 4 dropped (no assistant reply: 2, a role other than system/user/assistant/tool/function/ipython "
        "(narrator): 1, a turn without text: 1); replies end with </s>")


def test_no_usable_row_names_the_max_length_that_would_keep_one(tokenizer):
    rows = [{"instruction": "Sort: 9 8 7 6 5 4 3 2 1", "response": "1 2 3"}] * 3
    all_too_long = tokenized(tokenizer, rows, max_length=8)
    needs = min(all_too_long["needs"])
    assert needs > 8
    with pytest.raises(Refusal, match=rf"no training row can be used: 3 rows: 0 used, 3 dropped \(too long for "
                                      rf"--max-length 8: 3\); pass --max-length {needs} or more"):
        tokens.usable(all_too_long, "training", args_of("--max-length", "8"))
    assert len(tokens.usable(tokenized(tokenizer, rows, max_length=needs), "training", args_of())) == 3


def test_a_template_that_leaves_the_replies_out_drops_its_rows(tokenizer):
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    tokenizer.chat_template = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    try:
        assert "the chat template leaves the reply out of its rendering: 1" in tokens.counted(tokenized(tokenizer, rows))
    finally:
        tokenizer.chat_template = None


# Flags: range and syntax, LoRA targets against the model's modules, the output folder

@pytest.mark.parametrize("argv, message", [
    (["--lr", "-1"], "--lr must be > 0, got -1.0"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--lora-r", "0"], "--lora-r must be >= 1, got 0"),
    (["--lora-dropout", "2"], r"--lora-dropout must be in \[0, 1\), got 2.0"),
    (["--lora-alpha", "0"], "--lora-alpha must be > 0, got 0"),
    (["--save-every", "-1"], r"--save-every must be >= 0 \(0: none\), got -1"),
    (["--warmup-ratio", "1.5"], r"--warmup-ratio must be in \[0, 1\], got 1.5"),
    (["--max-grad-norm", "0"], "--max-grad-norm must be > 0"),
    (["--columns", "instruction=question,answer"], "--columns entry `answer` is not NEW=OLD"),
    (["--lora-targets", "q_proj,x_proj"], "--lora-targets x_proj matches no module \\(the others do\\) of .*; its linear "
                                          "layers are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj"),
    (["--lora-targets", "attn"], "--lora-targets attn matches no module of"),
    (["--output-dir", "/sys/outputs"], "--output-dir /sys/outputs cannot be written"),
    (["--output-dir", "/etc/hostname/run"], "--output-dir /etc/hostname/run lies under the file /etc/hostname"),
    (["--output-dir", ""], "--output-dir is empty"),
    (["--model", ""], "--model is empty"),
    (["--seed", "-1"], r"--seed must be in \[0, 4294967295\], got -1"),
    (["--epochs", "1e308", "--max-steps", "0"], r"--epochs must be in \[0, 1000000\]"),
    (["--lora-targets", "input_layernorm"], "input_layernorm names modules LoRA cannot adapt"),
    (["--lora-targets", "layers"], "layers names modules LoRA cannot adapt"),
    (["--attention", "flex_attention"], "flex_attention has no backward on CPU"),
])
def test_a_bad_flag_is_one_line_naming_the_rule(argv, message, tmp_path):
    argv = ["--output-dir", str(tmp_path / "out"), *argv]
    with pytest.raises(Refusal, match=message):
        settle.settle_launch(args_of(*argv), "lora")


def test_a_tracker_that_is_not_installed_is_refused(tmp_path):
    with mock.patch("importlib.util.find_spec", return_value=None):
        with pytest.raises(Refusal, match="--report-to wandb needs `pip install wandb`"):
            preflight.check_speed_options(args_of("--report-to", "wandb"), on_gpu=False)


def test_a_folder_with_files_a_run_would_overwrite_is_refused(tmp_path, capsys):
    (tmp_path / "README.md").write_text("# my project\n")
    with pytest.raises(Refusal, match="holds README.md but no run.json: a run would overwrite them"):
        preflight.check_output_dir(str(tmp_path))
    (tmp_path / "run.json").write_text("{}")  # an earlier run's folder: its own files, replaced with a note
    preflight.check_output_dir(str(tmp_path))
    assert "holds an earlier run; this run replaces its files" in capsys.readouterr().out
    preflight.check_output_dir(str(tmp_path), resuming=True)
    assert capsys.readouterr().out == ""


def model_folder(path, config: dict, files=("model.safetensors",)):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    for name in files:
        (path / name).write_bytes(b"")
    return str(path)


@pytest.mark.parametrize("config, files, message", [
    ({"model_type": "bert", "hidden_size": 32}, ("model.safetensors",), "is a bert encoder: it attends both ways"),
    ({"model_type": "t5"}, ("model.safetensors",), "is a t5 model, not a causal language model"),
    ({"model_type": "llama"}, ("pytorch_model.bin",), "holds no \\*.safetensors weights \\(it has pytorch_model.bin"),
    ({"model_type": "llama"}, (), "holds no \\*.safetensors weights; the recipes load"),
    (None, ("tokenizer.json",), "holds no config.json"),
])
def test_a_model_folder_that_cannot_train_is_named_before_loading(config, files, message, tmp_path):
    folder = tmp_path / "model"
    if config is None:
        folder.mkdir()
        for name in files:
            (folder / name).write_text("{}")
    else:
        model_folder(folder, config, files)
    with pytest.raises(Refusal, match=message):
        preflight.check_model_folder(str(folder))
    preflight.check_model_folder(model_folder(tmp_path / "decoder", {"model_type": "bert", "is_decoder": True}))


def test_the_context_of_a_gpt2_config_is_its_n_positions(tmp_path):
    folder = model_folder(tmp_path / "gpt2", {"model_type": "gpt2", "n_positions": 64})
    assert preflight.context_length(folder) == 64


# Checkpoints: a damaged one is found and skipped; another model's is refused

def fake_checkpoint(output_dir, step: int, model: str = str(TINY_MODEL), recipe: str = "lora"):
    folder = checkpoint.checkpoints_dir(output_dir) / f"step-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights" * step)
    state = {"step": step, "recipe": recipe, "model": model, "files": checkpoint.file_digests(folder)}
    (folder / checkpoint.STATE_FILE).write_text(json.dumps(state))
    return folder


def test_resume_auto_skips_a_damaged_checkpoint(tmp_path):
    older, newest = fake_checkpoint(tmp_path, 2), fake_checkpoint(tmp_path, 4)
    (newest / "model.safetensors").write_bytes(b"weights" * 3)  # truncated, e.g. by a full disk
    chosen, lines, refusal = checkpoint.choose_resume(args_of("--output-dir", str(tmp_path), "--resume", "auto"))
    assert (chosen, refusal) == (older, None)
    assert lines == [f"skipping damaged checkpoint {newest}: model.safetensors has 21 bytes, 28 were written"]
    (newest / "model.safetensors").write_bytes(b"weightz" * 4)  # same size, other bytes
    assert "model.safetensors has changed since it was written" in checkpoint.damage(newest)
    _, _, refusal = checkpoint.choose_resume(args_of("--output-dir", str(tmp_path), "--resume", str(newest)))
    assert refusal.startswith(f"--resume {newest} cannot be used: model.safetensors has changed")


def test_a_checkpoint_of_another_model_or_recipe_is_refused(tmp_path):
    fake_checkpoint(tmp_path, 2, model="org/other-model")
    _, _, refusal = checkpoint.choose_resume(args_of("--output-dir", str(tmp_path), "--resume", "auto"))
    assert refusal.startswith(f"{tmp_path}/checkpoints/step-2 was written by lora.py training org/other-model; "
                              f"this run is lora.py training {TINY_MODEL}: pass that --model")
    _, _, refusal = checkpoint.choose_resume(args_of("--output-dir", str(tmp_path), "--resume", "auto",
                                                     "--model", "org/other-model", recipe="full"))
    assert "this run is full.py training org/other-model" in refusal


def test_an_elastic_restart_continues_from_the_newest_intact_checkpoint(tmp_path, monkeypatch):
    fake_checkpoint(tmp_path, 2)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setattr(checkpoint, "launcher_argv", lambda: [sys.executable, "-m", "accelerate.commands.launch"])
    chosen, lines, refusal = checkpoint.choose_resume(args_of("--output-dir", str(tmp_path)))
    assert chosen.name == "step-2" and refusal is None and lines[0].startswith("restart 1 (accelerate launch")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert "already holds checkpoints of another run" in checkpoint.choose_resume(
        args_of("--output-dir", str(tmp_path)))[2]


# Through the real launcher: random flags and data shapes either train or stop with one line on
# every rank before the model loads.

DATA_SHAPES = {
    "good": [GOOD] * 40,
    "malformed": [GOOD] * 5 + [b'{"instruction": "x", "response": '] + [GOOD] * 5,
    "latin-1": [GOOD] * 5 + [b'{"instruction": "na\xefve", "response": "x"}'],
    "all too long": [{"instruction": "Sort: " + " ".join("9" * 200), "response": "9"}] * 40,
    "no text columns": [{"question": "q", "answer": "a"}] * 40,
    "chat with tools": [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 20
    + [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "look", "arguments": '{"at": "sky"}'}}]},
        {"role": "tool", "content": "blue"}, {"role": "assistant", "content": "It is blue."}]}] * 10
    + [{"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}] * 10,
}
# Only launched by the long test below (the random launches draw from DATA_SHAPES).
MORE_SHAPES = {
    "empty": [],
    "null responses": [GOOD] * 35 + [{"instruction": "x", "response": None}] * 5,
}
FLAGS = {"--lr": ["1e-3", "-1"], "--lora-r": ["8", "0"], "--save-every": ["0", "-1"], "--max-length": ["64", "12"],
         "--lora-targets": ["all-linear", "q_proj,nope"]}


@long_test
def test_random_launches_train_or_stop_with_one_line_before_the_model_loads(tmp_path):
    rng = random.Random(0)  # picks: a latin-1 line, a bad --lora-targets, chat with a tool turn (trains)
    trained = refused = 0
    for attempt in range(3):
        shape = rng.choice(sorted(DATA_SHAPES))
        # mostly good flags, so that the data's own verdict shows too
        flags = [item for flag, values in FLAGS.items() for item in (flag, values[rng.random() < 0.15])]
        dataset = write_lines(tmp_path / f"data-{attempt}.jsonl", DATA_SHAPES[shape])
        run = launch("lora", tmp_path / f"out-{attempt}", "--dataset", dataset, "--max-steps", "2",
                     "--batch-size", "2", *flags, config="ddp")
        errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
        if run.returncode == 0:
            trained += 1
            assert not errors and (tmp_path / f"out-{attempt}" / "adapter").is_dir(), (shape, flags)
            continue
        refused += 1
        assert len(errors) == 1, (shape, flags, run.output[-3000:])
        assert "model: loading the weights" not in run.output.split(errors[0])[0], (shape, flags)  # before the model loads
        assert not (tmp_path / f"out-{attempt}" / "run.json").exists()
        assert_no_traceback_of_ours(run.output)
        assert_the_refusal_ends_the_output(run.output, errors[0])
    assert trained and refused  # the seed picks both outcomes


# Every case above through the real launcher (~6 min, so opt-in; the three launches above run always).
EVERY_CASE = [
    (["--lr", "-1"], "good", "--lr must be > 0"),
    (["--lora-r", "0"], "good", "--lora-r must be >= 1"),
    (["--lora-dropout", "2"], "good", "--lora-dropout must be in [0, 1)"),
    (["--save-every", "-1"], "good", "--save-every must be >= 0"),
    (["--columns", "instruction"], "good", "--columns entry `instruction` is not NEW=OLD"),
    (["--lora-targets", "nope"], "good", "--lora-targets nope matches no module"),
    (["--lora-targets", "q_proj,nope"], "good", "--lora-targets nope matches no module (the others do)"),
    (["--output-dir", "/sys/outputs"], "good", "--output-dir /sys/outputs cannot be written"),
    ([], "malformed", ":6: not valid JSON"),
    ([], "latin-1", ":6: not UTF-8"),
    ([], "all too long", "no training row can be used"),
    ([], "no text columns", "the dataset has no usable text columns"),
    ([], "empty", "is an empty file"),
    (["--resume", "auto"], "good", "was written by lora.py training org/other-model"),  # see below
    ([], "chat with tools", None),  # trains, tool calls too; the rows without a reply are dropped and counted
    ([], "null responses", None),  # trains; the rows without a target are dropped and counted
]
DROPPED = {"chat with tools": "dropped (no assistant reply: ", "null responses": "empty target: "}


@long_test  # ~4 min
@pytest.mark.parametrize("flags, shape, refusal", EVERY_CASE, ids=lambda value: str(value)[:30])
def test_every_case_through_the_launcher(flags, shape, refusal, tmp_path):
    dataset = write_lines(tmp_path / "data.jsonl", {**DATA_SHAPES, **MORE_SHAPES}[shape])
    output_dir = tmp_path / "out"
    if "--resume" in flags:  # the output folder holds another model's checkpoint
        fake_checkpoint(output_dir, 2, model="org/other-model")
    run = launch("lora", output_dir, "--dataset", dataset, "--max-steps", "2", "--batch-size", "2", "--max-length", "64",
                 *flags, config="ddp")
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    if refusal is None:
        assert run.returncode == 0 and not errors, run.output[-3000:]
        assert DROPPED[shape] in run.output, run.output[-3000:]
        return
    assert run.returncode != 0 and len(errors) == 1 and refusal in errors[0], run.output[-3000:]
    assert "model: loading the weights" not in run.output and not (output_dir / "run.json").exists()
    assert_no_traceback_of_ours(run.output)
    assert_the_refusal_ends_the_output(run.output, errors[0])


def test_a_resume_that_would_change_the_run_is_refused(tmp_path):
    folder = fake_checkpoint(tmp_path, 4)
    state = json.loads((folder / checkpoint.STATE_FILE).read_text())
    state["settings"] = {"lora_r": 16, "lr": 2e-4}
    (folder / checkpoint.STATE_FILE).write_text(json.dumps(state))
    resume = ("--output-dir", str(tmp_path), "--resume", "auto")
    assert checkpoint.choose_resume(args_of(*resume))[2] is None
    assert "was trained with --lora-r 16, which a resumed run keeps" in checkpoint.choose_resume(
        args_of(*resume, "--lora-r", "8"))[2]
    assert "was trained with --lr 0.0002" in checkpoint.choose_resume(args_of(*resume, "--lr", "1e-5"))[2]
    assert "is at step 4, beyond --max-steps 2" in checkpoint.choose_resume(args_of(*resume, "--max-steps", "2"))[2]
    assert "is a run's folder, not a checkpoint" in checkpoint.choose_resume(
        args_of("--output-dir", str(tmp_path / "new"), "--resume", str(tmp_path)))[2]
    assert "does not exist" in checkpoint.choose_resume(
        args_of("--output-dir", str(tmp_path / "new"), "--resume", str(tmp_path / "nope")))[2]


def test_paths_from_a_run_file_expand_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    args = args_of("--output-dir", "~/runs/one", "--model", str(TINY_MODEL))
    run, _ = settle.settle_launch(args, "lora")
    assert run.output_dir == str(tmp_path / "runs" / "one") and run.model == str(TINY_MODEL.resolve())
    assert args.output_dir == "~/runs/one"  # the parsed flags stay as given: the settled run is a new one


def plain(processes: int) -> Launch:
    return Launch("ddp", processes=processes, on_gpu=False, visible_gpus=0, precision="no")


@pytest.mark.parametrize("batch_size, said", [
    ("16", "was written by 2 processes and resumes on 1 with the same global batch: each step takes the rows it "
           "took before"),
    ("8", "trained on 16 rows a step and this launch takes 8: the steps from here take other rows, so the curve "
          "changes; --global-batch-size 16 keeps it")])
def test_a_resume_on_another_number_of_processes_says_so(tmp_path, capsys, batch_size, said):
    from types import SimpleNamespace

    folder = fake_checkpoint(tmp_path, 2)
    state = json.loads((folder / checkpoint.STATE_FILE).read_text())
    (folder / checkpoint.STATE_FILE).write_text(json.dumps({**state, "processes": 2, "global_batch": 16}))
    one_process = SimpleNamespace(num_processes=1, is_main_process=True, distributed_type=SimpleNamespace(value="NO"))
    resume = checkpoint.resume_point(one_process, args_of("--output-dir", str(tmp_path), "--resume", "auto",
                                                          "--batch-size", batch_size, "--grad-accum", "1"), plain(1))
    assert resume == checkpoint.Resume(folder, "whole", by_name=False)
    assert said in capsys.readouterr().out


def test_a_local_folder_named_like_a_hub_id_is_checked_and_recorded_whole(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    model_folder(tmp_path / "org" / "encoder", {"model_type": "bert"})
    with pytest.raises(Refusal, match="org/encoder is a bert encoder"):
        preflight.check_model_folder("org/encoder")  # transformers would load this folder, not the hub's
    preflight.check_model_folder("org/not-here")  # a hub id: checked when it loads


# What a pasted Launch line asks of the network: nothing before its words are checked, one request after

UNREACHABLE_HUB = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0",
                   "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens there: refused at once, every time


@pytest.mark.parametrize("flag, value, message", [
    ("--dataset", "YOUR_DATA", "--dataset YOUR_DATA is the word plan.py's Launch line asks you to replace: give your "
                               "data instead"),
    ("--dataset", "my_data.jsonl", "--dataset my_data.jsonl does not exist; give a .jsonl"),
    ("--eval-dataset", "held_out/", "--eval-dataset held_out/ does not exist"),
    ("--model", "YOUR_MODEL", "--model YOUR_MODEL is the word plan.py's Launch line asks you to replace"),
])
def test_a_placeholder_or_a_missing_path_is_refused_before_the_hub_is_asked(flag, value, message, tmp_path,
                                                                             monkeypatch):
    asked = []
    monkeypatch.setattr(preflight, "hub_unanswered", lambda: asked.append("hub") or None)
    monkeypatch.chdir(tmp_path)
    argv = ["--output-dir", str(tmp_path / "out"), "--model", "org/some-model", flag, value]
    with pytest.raises(Refusal, match=message) as refusal:
        settle.settle_launch(args_of(*argv), "lora")
    assert "\n" not in refusal.value.message and asked == []
    from common.data.data_files import read_splits  # scripts/inspect_data.py reads --dataset with it, as the recipes do

    if flag == "--dataset":
        with pytest.raises(Refusal, match=message):
            read_splits(value)


def test_a_hub_dataset_the_cache_lacks_offline_names_the_fix(monkeypatch):
    from huggingface_hub import constants

    from common.data.data_files import read_splits

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as the recipes set it when the hub does not answer
    with pytest.raises(Refusal, match=r"^--dataset someorg/somedata is not in this machine's cache and the hub .* is "
                                      "not read here .*; load it once where the hub can be reached"):
        read_splits("someorg/somedata")


def test_the_plans_launch_line_with_its_placeholder_stops_in_one_line_without_the_network(tmp_path):
    """plan.py's Launch line for CodeLlama-34B pasted as printed (a pipeline of 2 here, on 2 CPU processes), with
    a hub that does not answer: the placeholder is refused on every rank before anything asks the hub. It used to
    try the model's config.json 6 times over ~25 s on each rank first (`Retrying in 1s [Retry 1/5]`)."""
    run = launch("lora", tmp_path / "out", "--model", "codellama/CodeLlama-34b-hf", "--dataset", "YOUR_DATA",
                 "--batch-size", "1", "--max-length", "512", "--pipeline-stages", "2", "--grad-accum", "8",
                 config="pipeline", env=UNREACHABLE_HUB)
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert run.returncode != 0 and len(errors) == 1, run.output[-3000:]
    assert errors[0].startswith("error: --dataset YOUR_DATA is the word plan.py's Launch line asks you to replace")
    assert "Retrying" not in run.output and "127.0.0.1:9" not in run.output, run.output[-3000:]
    assert_no_traceback_of_ours(run.output)
    assert_the_refusal_ends_the_output(run.output, errors[0])


def test_a_hub_that_does_not_answer_is_asked_once_and_a_model_it_lacks_is_one_line(tmp_path):
    run = launch("lora", tmp_path / "out", "--model", "org/not-downloaded", "--max-steps", "2",
                 "--pipeline-stages", "2", "--grad-accum", "2", config="pipeline",
                 env={**UNREACHABLE_HUB, "HF_HUB_CACHE": str(tmp_path / "hub")})
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert run.returncode != 0 and len(errors) == 1, run.output[-3000:]
    assert errors[0].startswith("error: --model org/not-downloaded is not in this machine's hub cache and the hub "
                                "(http://127.0.0.1:9) did not answer: ")
    assert "hf download org/not-downloaded" in errors[0]
    assert "Retrying" not in run.output and "model: loading the weights" not in run.output, run.output[-3000:]
    assert_the_refusal_ends_the_output(run.output, errors[0])


@long_test  # (every run: the refusals when the hub does not answer)
def test_a_model_in_the_hub_cache_trains_when_the_hub_does_not_answer(tmp_path):
    """A hub id the cache holds (the bundled tiny model, laid out as huggingface_hub caches a download) trains
    from the cache alone: one request finds the hub silent, the start-up says so once, and no read retries."""
    import shutil

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(TINY_MODEL, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    run = launch("lora", tmp_path / "out", "--model", "org/tiny", "--max-steps", "2", "--batch-size", "2",
                 config="ddp", env={**UNREACHABLE_HUB, "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert run.returncode == 0, run.output[-3000:]
    said = [line for line in run.output.splitlines() if line.startswith("hub: ")]
    assert said == ["hub: http://127.0.0.1:9 did not answer ([Errno 111] Connection refused); reading org/tiny from "
                    "this machine's cache only, as HF_HUB_OFFLINE=1 would"], run.output[-3000:]
    assert "Retrying" not in run.output and run.run_json()["arguments"]["model"] == "org/tiny"


def test_every_hub_id_a_launch_line_names_is_taken_as_one():
    """plan.py launches an alias's hub id; a name with a dot in it (Qwen/Qwen2.5-7B, meta-llama/Llama-3.1-8B) was
    read as a file name and refused as a path that does not exist. Data files with a folder stay paths."""
    import planner

    from common.data.data_files import looks_local

    for alias, hub_id in planner.HUB_IDS.items():
        if alias != "tiny-llama":  # (the bundled model's folder)
            assert not looks_local(hub_id), hub_id
            quick_checks.check_paths(args_of("--model", hub_id))
    assert all(looks_local(path) for path in ("data/train.jsonl", "runs/rows.json.gz", "held_out/", "/abs", "x"))
