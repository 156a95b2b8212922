"""What a run says and records, read as a user reads it: a preference run's console line has its rewards, its
plan line names its recipe and says per process on a CPU, a tiny evaluation split is warned of, counts are
singular where they are one, a --config file's values are named as its in run.json's settled_from, and another
project's name for a flag gets this recipe's name."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO, launch

sys.path.insert(0, str(REPO / "recipes"))

from common.data.data_files import LONG_WAIT_ROWS, say_long_wait  # noqa: E402
from common.data.tokens import many  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.refusal import Refusal  # noqa: E402


def test_a_preference_run_says_its_rewards_its_recipe_and_a_tiny_evaluation(tmp_path):
    pairs = (REPO / "data" / "preferences" / "eval.jsonl").read_text().splitlines()[:3]
    evaluation = tmp_path / "eval.jsonl"
    evaluation.write_text("\n".join(pairs) + "\n")
    run = launch("dpo", tmp_path / "out", "--eval-dataset", str(evaluation), "--max-steps", "2", "--batch-size", "2",
                 "--log-every", "1", config=None)
    assert run.returncode == 0, run.output[-3000:]
    step_lines = [line for line in run.output.splitlines() if line.startswith("step 1: loss")]
    assert step_lines and "rewards/margins" in step_lines[0] and "rewards/accuracies" in step_lines[0], step_lines
    [plan] = [line for line in run.output.splitlines() if line.startswith("plan: ")]
    assert plan.startswith("plan: dpo (lora) with ") and "per process" in plan and "per GPU" not in plan, plan
    assert "warning: evaluation has 3 pairs, too few" in run.output
    assert "evaluation 3 pairs:" in run.output


def test_counts_are_singular_where_they_are_one():
    assert (many(1, "pair"), many(2, "pair"), many(1_000, "evaluation row")) == ("1 pair", "2 pairs",
                                                                               "1,000 evaluation rows")


def test_a_run_files_values_are_named_in_settled_from(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 2.0e-4\nepochs: 2\n")
    run = parse_args(recipe_flags("lora", "recipe\n"), ["--config", str(path), "--lr", "1e-3"])
    assert run.lr == 1e-3 and run.epochs == 2  # a typed flag wins over the file
    assert run.settled_from == {"epochs": f"--config {path}"}


@pytest.mark.parametrize("key, ours", [("learning_rate", "lr"), ("per_device_train_batch_size", "batch-size"),
                                       ("gradient_accumulation_steps", "grad-accum"), ("max_seq_length", "max-length")])
def test_another_projects_name_gets_this_recipes(key, ours, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"{key}: 1\n")
    with pytest.raises(Refusal, match=f"`{key}` is not a flag of this recipe; this recipe calls it `{ours}`"):
        parse_args(recipe_flags("lora", "recipe\n"), ["--config", str(path)])


@pytest.mark.parametrize("argv, hint", [
    (["--learning-rate", "1e-4"], "--learning-rate: this recipe calls it `--lr`"),
    (["--lora-rank=8"], "--lora-rank: this recipe calls it `--lora-r`"),
    (["--max-step", "3"], "--max-step: did you mean `--max-steps`?"),
    (["--epoch", "2", "--warmup-steps", "10"], "--epoch: did you mean `--epochs`?; --warmup-steps: this recipe "
                                               "calls it `--warmup-ratio` (a fraction of the steps)"),
])
def test_a_mistyped_flag_gets_the_closest_flags_in_its_one_line(argv, hint, capsys):
    with pytest.raises(Refusal):
        parse_args(recipe_flags("lora", "recipe\n"), argv)
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: unrecognized arguments: ") and "\n" not in line
    assert line.endswith(f"; {hint}; see --help"), line


def test_the_scripts_flags_answer_a_mistyped_one_alike(capsys):
    from common.outputs.script_flags import generate_flags

    with pytest.raises(Refusal):
        generate_flags("generate\n").parse_args(["outputs/lora", "--promt", "hi"])
    assert capsys.readouterr().err.strip() == (
        "error: unrecognized arguments: --promt hi; --promt: did you mean `--prompt`?; see --help")


@pytest.mark.parametrize("device, card", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA RTX 6000 Ada Generation",
                                                                             "rtx6000-ada"),
                                          ("NVIDIA GeForce RTX 4090", "4090"), ("Tesla V100-SXM2-32GB", None)])
def test_a_runs_plan_hint_names_its_card_as_plan_py_takes_it(device, card):
    """The hint a launch prints when its plan does not fit names the GPU as plan.py takes it (plan.py refuses
    --gpu-memory without --gpu), and the command runs as printed (a card it does not know: a word to replace)."""
    import shlex
    import subprocess

    import planner
    from common.launching.memory_plan import card_flags

    assert planner.card_of_device(device) == card
    flags = card_flags(device, 47.5)
    assert flags == f"--gpu {card or 'YOUR_GPU'} --gpu-memory 48"
    if card:
        done = subprocess.run([sys.executable, str(REPO / "scripts" / "plan.py"), "--model", "tinyllama-1.1b",
                               "--gpus", "1", *shlex.split(flags)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_a_long_sample_is_one_short_console_line():
    """A row of 16,000 tokens as its own reference (plain text, no prompt) printed whole filled pages of the
    console; the line keeps its start and its end (samples.jsonl keeps it whole)."""
    from common.data.formats import shortened

    text = "start " + "word " * 20_000 + "end"
    line = shortened(text)
    assert len(line) <= 160 and line.startswith("start ") and line.endswith(" word end")
    assert "[... 100,009 characters in all ...]" in line
    assert all(word in ("start", "word", "end") for word in line.replace("[... 100,009 characters in all ...]", "").split())
    assert shortened("1 2 4") == "1 2 4"
    system = "You are a careful assistant who answers in one word only, " * 2  # cut at a word, never mid-word
    assert shortened(system, 80).startswith("You are a careful assistant who answers ")


def test_run_json_names_the_program_its_hash_and_its_git_state(tmp_path):
    """An edited copy is told from the recipe it was copied from: the file's path and SHA-256, and in a git work
    tree the commit, whether the tree had changes and the file's own state."""
    import hashlib
    import subprocess

    from common.outputs.runlog import program_record

    program = tmp_path / "my_lora.py"
    program.write_text("print('hi')\n")
    outside = program_record(str(program))
    assert outside == {"path": str(program), "sha256": hashlib.sha256(b"print('hi')\n").hexdigest(), "git": None}

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "other.txt").write_text("x\n")
    git("add", "other.txt")
    git("commit", "-qm", "first")
    commit = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert program_record(str(program))["git"] == {"commit": commit, "dirty": True, "program": "untracked"}
    git("add", "my_lora.py")
    git("commit", "-qm", "second")
    record = program_record(str(program))["git"]
    assert record["program"] == "committed" and not record["dirty"] and record["commit"] != commit
    program.write_text("print('edited')\n")
    assert program_record(str(program))["git"] | {"commit": None} == {"commit": None, "dirty": True, "program": "changed"}


def test_the_data_lines_name_the_chat_template_that_renders_chat_rows(capsys):
    from types import SimpleNamespace

    from common.data.formats import DEFAULT_CHAT_TEMPLATE, chat_template_line

    main = SimpleNamespace(is_main_process=True)
    args = SimpleNamespace(chat_template=None, model="org/model")
    for template, chat_template, which in (
            (DEFAULT_CHAT_TEMPLATE, None, "the plain default (`<|user|>` / `<|assistant|>` turns), as org/model's "
                                          "tokenizer has none (--chat-template FILE for another)"),
            ("{{ messages }}", None, "org/model's own chat template"), ("{{ messages }}", "mine.jinja", "--chat-template mine.jinja")):
        chat_template_line(main, SimpleNamespace(chat_template=template),
                           SimpleNamespace(chat_template=chat_template, model="org/model"), chat=True)
        assert capsys.readouterr().out == f"data: chat rows rendered with {which}; the tokenizer saved with the model carries it\n"
    chat_template_line(main, SimpleNamespace(chat_template=DEFAULT_CHAT_TEMPLATE), args, chat=False)  # no chat rows
    chat_template_line(SimpleNamespace(is_main_process=False), SimpleNamespace(chat_template="x"), args, chat=True)
    assert capsys.readouterr().out == ""


def test_a_library_notice_printed_on_every_rank_is_dropped_and_the_rest_kept(capsys):
    from common.quiet import printed_notices_dropped

    with printed_notices_dropped():
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("plan: kept")
        print("no newline yet", end="")
    print()
    assert capsys.readouterr().out == "plan: kept\nno newline yet\n"


def test_a_long_tokenising_is_said_in_one_line_by_the_first_process(capsys, monkeypatch):
    """datasets' bars are off: a tokenising of many rows says so once, before it starts; a short one says nothing."""
    say_long_wait(LONG_WAIT_ROWS - 1, "rows")
    assert capsys.readouterr().out == ""
    say_long_wait(300_000, "prompts")
    assert capsys.readouterr().out == "tokenising 300,000 prompts (a rerun reads datasets' cache)\n"
    monkeypatch.setenv("RANK", "1")
    say_long_wait(300_000, "prompts")
    assert capsys.readouterr().out == ""
