"""scripts/measure/compare_trl.py: our recipe against TRL's SFTTrainer on the same workload.

The end-to-end run checks the output and that both sides trained on the same target tokens; the
unit tests check the two things that make the workloads the same: TRL tokenises the rows as the
recipe does, and the worker feeds them in the order the recipe's loader does. No timing is asserted.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO, TINY_MODEL, long_test

sys.path.insert(0, str(REPO / "scripts" / "measure"))
sys.path.insert(0, str(REPO / "recipes"))
import compare_trl  # noqa: E402
import trl_sft_worker  # noqa: E402

STEPS = 6
RUN_LINE = re.compile(r"^round (\d+)  (ours|TRL) +([0-9.]+) tokens/s  (\d+) steps  timed ([0-9.]+) s")


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    output = tmp_path_factory.mktemp("compare_trl")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "measure" / "compare_trl.py"), "--rounds", "1", "--steps",
                           str(STEPS), "--output-dir", str(output)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, json.loads((output / "summary.json").read_text())


@long_test  # the end-to-end run (~35 s): in the long run; the unit tests below in every run
def test_last_line_is_the_ratio(comparison):
    stdout, summary = comparison
    last = stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"ratio: (\d+\.\d\d)", last)
    assert match, last
    assert float(match.group(1)) > 0
    assert float(match.group(1)) == pytest.approx(summary["ratio"], abs=0.005)


@long_test  # the end-to-end run (~35 s): in the long run; the unit tests below in every run
def test_both_sides_report_tokens_per_second(comparison):
    stdout, summary = comparison
    runs = [RUN_LINE.match(line) for line in stdout.splitlines() if line.startswith("round ")]
    assert sorted(match.group(2) for match in runs) == ["TRL", "ours"], stdout
    for match in runs:
        assert float(match.group(3)) > 0 and int(match.group(4)) == STEPS and float(match.group(5)) > 0
    assert all(value > 0 for value in summary["median_tokens_per_s"].values())
    assert "limits:" in stdout and "median tokens/s: ours" in stdout


@long_test  # the end-to-end run (~35 s): in the long run; the unit tests below in every run
def test_both_sides_trained_on_the_same_target_tokens(comparison):
    _, summary = comparison
    ours, trl = (next(run for run in summary["runs"] if run["side"] == side) for side in ("ours", "trl"))
    # Step by step, from each side's own metrics.jsonl (the recipe's counts and the worker's collator's).
    assert len(ours["step_tokens"]) == len(trl["step_tokens"]) == STEPS
    assert ours["step_tokens"] == trl["step_tokens"]
    assert ours["timed_tokens"] == trl["timed_tokens"] == sum(ours["step_tokens"][1:]) > 0
    # The same tokens and masks give the same loss: global-batch token means, equal up to float rounding.
    assert trl["global_token_mean_loss"] is True
    assert trl["mean_loss"] == pytest.approx(ours["mean_loss"], rel=1e-3)
    assert trl["torch_threads"] == compare_trl.threads_per_process(2)  # cores shared, not oversubscribed


@pytest.fixture(scope="module")
def tokenizer():
    from common.model import modeling

    return modeling.load_tokenizer(str(TINY_MODEL))


def test_trl_tokenises_rows_as_the_recipe_does(tokenizer, tmp_path):
    args = trl_sft_worker.parse_args(["--output-dir", str(tmp_path), "--max-steps", "1", "--batch-size", "2"])
    prompt_completion, expected = trl_sft_worker.recipe_rows(args, tokenizer)
    picked = [0, 1, 2, 500, len(expected) - 1]
    trainer = trl_sft_worker.build_trainer(args, tokenizer, [prompt_completion[i] for i in picked])
    prepared = list(trainer.train_dataset.select_columns(["input_ids", "labels"]))
    assert len(prepared) == len(picked)
    for row, index in zip(prepared, picked):
        assert row["input_ids"] == expected[index]["input_ids"]
        assert row["labels"] == expected[index]["labels"]  # the same positions trained, the same targets
        assert row["input_ids"][0] == tokenizer.bos_token_id and row["input_ids"][-1] == tokenizer.eos_token_id
    trl_sft_worker.check_same_tokens(prepared, [expected[i] for i in picked])  # the worker's own check agrees
    with pytest.raises(SystemExit):
        trl_sft_worker.check_same_tokens(prepared, [expected[i] for i in reversed(picked)])


def test_training_order_is_the_recipes_loader_order():
    """Over an epoch boundary, each rank reads the micro-batches of recipes/lora.py's prepared loader."""
    from accelerate.data_loader import prepare_data_loader
    from accelerate.utils import set_seed
    from common.data import batches
    from torch.utils.data import DataLoader

    rows, batch_size, grad_accum, processes, seed = 203, 4, 3, 2, 42
    steps = 2 * (rows // batch_size // processes // grad_accum) + 3  # into the third epoch
    order = trl_sft_worker.training_order(rows, seed, steps, batch_size, grad_accum, processes)

    def rank_batches(loader, process_index, recipe):
        set_seed(seed)  # the recipe's set_seed precedes prepare; the sampler's seed is torch's initial seed
        prepared = prepare_data_loader(loader, num_processes=processes, process_index=process_index,
                                       put_on_device=False, use_seedable_sampler=True)
        if recipe:  # the recipe's own loop: whole optimizer steps, each epoch reshuffled
            stream = batches.optimizer_steps(prepared, grad_accum)
            return [batch.tolist() for _ in range(steps) for batch in next(stream)[1]]
        return [batch.tolist() for batch in prepared][: steps * grad_accum]

    for rank in range(processes):
        recipe = DataLoader(list(range(rows)), batch_size=batch_size, shuffle=True, drop_last=True)
        sequential = DataLoader(order, batch_size=batch_size, shuffle=False)
        assert rank_batches(recipe, rank, True) == rank_batches(sequential, rank, False)
    assert len(order) == steps * batch_size * grad_accum * processes


def test_timed_part_leaves_out_the_first_step():
    records = [{"type": "train", "step": step, "tokens": tokens, "elapsed_s": elapsed}
               for step, tokens, elapsed in ((1, 10, 5.0), (2, 20, 5.5), (3, 30, 6.0))]
    records.append({"type": "eval", "step": 3, "loss": 1.0})
    timed = compare_trl.timed_part(records)
    assert timed["timed_s"] == pytest.approx(1.0) and timed["timed_tokens"] == 50
    assert timed["tokens_per_s"] == pytest.approx(50.0) and timed["step_tokens"] == [10, 20, 30]


def test_the_conclusion_follows_the_measured_ratio():
    assert "bookkeeping" in compare_trl.verdict(1.8)
    assert compare_trl.verdict(0.5).startswith("TRL is 2.00x faster here")
    assert "within 10%" in compare_trl.verdict(1.02) and "bookkeeping" not in compare_trl.verdict(1.02)


def test_a_failed_launch_is_named_in_one_line():
    refused = ["Loading weights: 100%", "error: --max-length 4096 is beyond the model's context (1024)"]
    assert compare_trl.failure_cause(refused) == "--max-length 4096 is beyond the model's context (1024)"
    crashed = ["[rank0]: Traceback (most recent call last):", '[rank0]:   File "x.py", line 1',
               "[rank0]: ValueError: num_samples should be a positive integer value"]
    assert compare_trl.failure_cause(crashed) == "[rank0]: ValueError: num_samples should be a positive integer value"


def test_both_sides_get_the_model_data_and_precision_asked_for(tmp_path):
    """On a GPU (scripts/measure/gpu_check.py's trl part) both launches take the model, data and bf16 given."""
    args = compare_trl.parse_args(["--model", "/models/tinyllama", "--dataset", "rows.jsonl", "--mixed-precision",
                                   "bf16", "--processes", "1"])
    for side in ("ours", "trl"):
        command = compare_trl.launch_command(side, tmp_path, args, 29500)
        assert command[command.index("--mixed_precision") + 1] == "bf16"
        assert command[command.index("--model") + 1] == "/models/tinyllama"
        assert command[command.index("--dataset") + 1] == "rows.jsonl"
    default = compare_trl.launch_command("trl", tmp_path, compare_trl.parse_args([]), 29500)
    assert default[default.index("--mixed_precision") + 1] == "no" and "--dataset" not in default


def test_with_liger_each_side_gets_its_own_liger():
    """--liger: the recipe's flag on our side, SFTTrainer's use_liger_kernel on TRL's (its fastest switch)."""
    args = compare_trl.parse_args(["--liger", "--processes", "1"])
    for side in ("ours", "trl"):
        assert "--liger" in compare_trl.launch_command(side, REPO / "out", args, 29500)
    worker = trl_sft_worker.parse_args(["--output-dir", "/tmp/unused", "--max-steps", "4", "--liger"])
    assert trl_sft_worker.sft_config(worker, 1).use_liger_kernel
    plain = trl_sft_worker.parse_args(["--output-dir", "/tmp/unused", "--max-steps", "4"])
    assert not trl_sft_worker.sft_config(plain, 1).use_liger_kernel
