"""--batch-size auto and --global-batch-size (recipes/common/launching/batch_size.py), in-process.

The real launches of both are in test_equivalence.py (test_accumulation_does_not_change_the_updates).
"""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
import planner  # noqa: E402
from common.launching import batch_size  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.launching.launch import Launch  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402

DDP_ON_2_CPUS = Launch("ddp", processes=2, on_gpu=False, visible_gpus=0, precision="no")


def settle(*argv: str, launch: Launch = DDP_ON_2_CPUS, recipe: str = "lora"):
    return batch_size.settle(parse_args(recipe_flags(recipe), list(argv)), recipe, launch)


def test_nothing_asked_changes_nothing():
    args, line = settle("--batch-size", "4", "--grad-accum", "3")
    assert (args.batch_size, args.grad_accum, line) == (4, 3, None)


def test_the_global_batch_sets_the_accumulation():
    args, line = settle("--batch-size", "4", "--global-batch-size", "32")
    assert (args.batch_size, args.grad_accum) == (4, 4)
    assert line == "batch: 4 per process x --grad-accum 4 x 2 process(es) = 32 sequences per step"


def plan_memory(monkeypatch, gib: float):
    monkeypatch.setattr(batch_size, "memory_gib", lambda launch: (gib, "test memory"))


def test_auto_takes_the_largest_micro_batch_the_plan_fits(monkeypatch):
    plan_memory(monkeypatch, 0.05)  # 50 MiB: a few sequences of the tiny model at 512 tokens
    shape = planner.load_shape("tiny-llama")
    fits = planner.max_micro_batch(shape, "lora", "ddp", 2, 0.05, seq_len=512, precision="fp32")
    assert 1 < fits < 256  # the memory really limits it
    args, line = settle("--batch-size", "auto")
    assert (args.batch_size, args.grad_accum) == (fits, 1)
    assert f"the plan fits {fits} in 0.05 GiB, test memory" in line
    assert args.batch_plan["planner"]["fits"] == fits and args.batch_plan["asked"]["batch_size"] == "auto"


def test_auto_within_a_global_batch_divides_it(monkeypatch):
    plan_memory(monkeypatch, 0.05)
    fits = settle("--batch-size", "auto")[0].batch_size
    per_process = 3 * fits + 3  # a count whose largest divisor up to `fits` is below `fits`
    args, _ = settle("--batch-size", "auto", "--global-batch-size", str(2 * per_process))
    assert args.batch_size <= fits and per_process % args.batch_size == 0
    assert args.batch_size * args.grad_accum == per_process


def test_auto_plans_a_pipelines_stage_with_the_micro_batches_it_holds(monkeypatch):
    """Under --pipeline-stages the plan is the busiest stage's (its layers, the micro-batches its schedule
    keeps in flight at most), not one process holding the whole model."""
    from dataclasses import replace

    plan_memory(monkeypatch, 0.1)
    whole = settle("--batch-size", "auto")[0].batch_size
    staged = replace(DDP_ON_2_CPUS, pipeline_stages=2)
    args, line = settle("--batch-size", "auto", launch=staged)
    shape = planner.load_shape("tiny-llama")
    expected = planner.max_micro_batch(shape, "lora", "pipeline", 2, 0.1, seq_len=512, precision="fp32",
                                       grad_accum=batch_size.PIPELINE_FULL, pipeline_stages=2)
    assert args.batch_size == expected and "x 1 process(es)" in line  # one pipeline: one data-parallel rank
    in_flight = planner.per_gpu_bytes(shape, "lora", "pipeline", 2, expected, 512, precision="fp32",
                                      grad_accum=1, pipeline_stages=2)
    assert in_flight["total"] < planner.per_gpu_bytes(shape, "lora", "pipeline", 2, expected, 512, precision="fp32",
                                                      grad_accum=batch_size.PIPELINE_FULL,
                                                      pipeline_stages=2)["total"]  # planned with 2 in flight
    assert expected != whole


def test_a_longer_context_plans_a_smaller_micro_batch(monkeypatch):
    plan_memory(monkeypatch, 0.05)
    short = settle("--batch-size", "auto", "--max-length", "256")[0].batch_size
    long = settle("--batch-size", "auto", "--max-length", "1024")[0].batch_size
    assert long < short


@pytest.mark.parametrize("argv, message", [
    (["--global-batch-size", "33"], "--global-batch-size 33 does not split over 2 data-parallel processes; use 34 or 32"),
    (["--global-batch-size", "24", "--batch-size", "5"],
     "--global-batch-size 24 is 12 sequences per process, which --batch-size 5 does not divide; use --batch-size 4"),
    (["--global-batch-size", "32", "--batch-size", "4", "--grad-accum", "2"],
     "needs --grad-accum 4, but --grad-accum 2 was given; drop one of them"),
])
def test_a_batch_that_cannot_add_up_is_refused(argv, message):
    with pytest.raises(Refusal, match=message.replace("(", r"\(")):
        settle(*argv)


def test_auto_refuses_when_not_one_sequence_fits(monkeypatch):
    plan_memory(monkeypatch, 0.0001)
    with pytest.raises(Refusal, match=r"not even one sequence of --max-length 512 fits .* scripts/plan.py"):
        settle("--batch-size", "auto")


def test_auto_refuses_a_model_it_cannot_plan(tmp_path):
    with pytest.raises(Refusal, match="--batch-size auto plans from the model's config.json.*give --batch-size N"):
        settle("--batch-size", "auto", "--model", str(tmp_path / "missing"))


def test_the_flag_accepts_auto_or_a_number_only(capsys, tmp_path):
    with pytest.raises(SystemExit):
        parse_args(recipe_flags("lora"), ["--batch-size", "big"])
    assert "invalid number or `auto` value: 'big'" in capsys.readouterr().err
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("batch-size: big\n")
    with pytest.raises(Refusal, match="`batch-size: big` is not a valid number or `auto`"):
        parse_args(recipe_flags("lora"), ["--config", str(run_yaml)])
    run_yaml.write_text("batch-size: auto\nglobal-batch-size: 32\n")
    from_file = parse_args(recipe_flags("lora"), ["--config", str(run_yaml)])
    assert (from_file.batch_size, from_file.global_batch_size) == ("auto", 32)
    assert parse_args(recipe_flags("lora"), ["--batch-size", "AUTO"]).batch_size == "auto"


@pytest.mark.parametrize("start, largest_that_runs, per_rank, expected", [
    (32, 32, None, 32),  # the plan was right
    (32, 20, None, 16),  # halving
    (24, 10, 24, 6),  # halving, kept to divisors of a global batch's per-process share: 24 -> 12 -> 6
    (8, 0, None, 0),  # nothing runs
])
def test_the_gpu_probe_backs_off_to_a_size_that_runs(start, largest_that_runs, per_rank, expected):
    tried = []

    def fits_step(size):
        tried.append(size)
        return size <= largest_that_runs

    assert batch_size.back_off(fits_step, start, per_rank) == expected
    assert tried[0] == start and all(b < a for a, b in zip(tried, tried[1:]))


def test_the_gpu_probe_does_nothing_without_a_gpu_or_auto():
    args, _ = settle("--batch-size", "auto")
    assert batch_size.confirm_on_gpu(accelerator=None, launch=DDP_ON_2_CPUS, model=None, run=args, token_losses=None) is args  # no GPU: no probe
    gpu = Launch("ddp", processes=2, on_gpu=True, visible_gpus=1, precision="bf16")
    typed, _ = settle("--batch-size", "4")
    confirmed = batch_size.confirm_on_gpu(accelerator=None, launch=gpu, model=None, run=typed, token_losses=None)  # a typed size: no probe
    assert confirmed.batch_size == 4
