"""Every recipe evaluates the model as loaded before its first step (step 0), unless --no-eval-on-start: the run
shows what it changed, and the steps draw the same random numbers with or without it."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from conftest import REPO, launch

sys.path.insert(0, str(REPO / "recipes"))
from common.training import runtime  # noqa: E402


def test_what_runs_inside_leaves_the_random_state_as_it_was():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with runtime.same_random_state():
        torch.rand(5)
    assert torch.equal(torch.rand(3), expected)


def test_a_lora_run_logs_step_0_and_trains_the_curve_it_trains_without_it(tmp_path):
    """With dropout (the steps draw random numbers): the baseline is logged and said as step 0, the curve is the
    one --no-eval-on-start gives, and the last evaluation is scored as the first was. (One process: the random
    state is each process's own, and the suite's every other launch runs without the baseline.)"""
    flags = ["--max-steps", "2", "--batch-size", "4", "--lr", "5e-3", "--lora-dropout", "0.1"]
    with_it = launch("lora", tmp_path / "with", *flags, "--eval-on-start", processes=1)
    without = launch("lora", tmp_path / "without", *flags, processes=1)
    assert with_it.returncode == without.returncode == 0, with_it.output[-3000:] + without.output[-3000:]
    first, last = with_it.metrics("eval")
    assert (first["step"], last["step"]) == (0, 2) and "eval at step 0: eval_loss" in with_it.output
    assert [record["step"] for record in without.metrics("eval")] == [2]
    assert first["eval_loss"] > last["eval_loss"]  # the steps lowered the held-out loss from where it started
    assert with_it.losses() == without.losses()
    assert [r["grad_norm"] for r in with_it.metrics()] == [r["grad_norm"] for r in without.metrics()]
    assert last == without.metrics("eval")[0]


def test_a_dpo_run_starts_where_the_policy_is_the_reference(tmp_path):
    """Step 0 of DPO: the adapters are zero, the policy is the reference, so every held-out reward is 0 and the
    loss log 2 (a check of the reference before anything trains)."""
    run = launch("dpo", tmp_path / "out", "--max-steps", "1", "--batch-size", "4", "--eval-on-start", processes=1)
    assert run.returncode == 0, run.output[-3000:]
    first = run.metrics("eval")[0]
    assert first["step"] == 0 and first["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["eval_rewards/margins"] == pytest.approx(0, abs=1e-6)
