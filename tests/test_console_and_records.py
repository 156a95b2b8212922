"""What a run says and records, read as a user reads it: a preference run's console line has its rewards, its
plan line names its recipe and says per process on a CPU, a tiny evaluation split is warned of, counts are
singular where they are one, a --config file's values are named as its in run.json's settled_from, and another
project's name for a flag gets this recipe's name."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO, launch

sys.path.insert(0, str(REPO / "recipes"))

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
    from common.outputs.report import shortened

    text = "start " + "word " * 20_000 + "end"
    line = shortened(text)
    assert len(line) <= 130 and line.startswith("start ") and line.endswith("end") and " ... " in line
    assert shortened("1 2 4") == "1 2 4"
