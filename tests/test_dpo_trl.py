"""recipes/dpo.py equals TRL's DPOTrainer (--loss orpo: trl.experimental's ORPOTrainer) on the same rows: the same
tiny model, pairs, adapter, beta, loss and optimizer give the same loss, rewards and log-probabilities, step by step
(fp32, CPU, one process). Each step's batch is all the pairs, so the order each side reads them in does not
matter."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from conftest import REPO, launch, long_test

PAIRS = 8
STEPS = 3


def standard_pairs(path) -> None:
    """Prompt / chosen / rejected text pairs of the bundled toy task: the sorted digits against a wrong order."""
    draw = random.Random(0)
    with open(path, "w") as file:
        for _ in range(PAIRS):
            digits = sorted(draw.sample("0123456789", 3 + draw.randint(0, 1)), key=lambda _: draw.random())
            if sorted(digits) == digits[::-1]:  # the two replies would be the same
                digits.reverse()
            file.write(json.dumps({"prompt": f"Sort: {' '.join(digits)}\nAnswer:", "chosen": " " + " ".join(sorted(digits)),
                                   "rejected": " " + " ".join(reversed(digits))}) + "\n")


@pytest.mark.parametrize("loss", ["sigmoid", pytest.param("ipo", marks=long_test), pytest.param("orpo", marks=long_test)])
def test_the_first_steps_equal_trls(tmp_path, loss):
    pairs = tmp_path / "pairs.jsonl"
    standard_pairs(pairs)
    flags = ["--dataset", str(pairs), "--max-steps", str(STEPS), "--batch-size", str(PAIRS), "--grad-accum", "1",
             "--lr", "5e-3", "--lora-dropout", "0", "--warmup-ratio", "0", "--loss", loss]
    ours = launch("dpo", tmp_path / "ours", *flags, "--eval-dataset", str(pairs), processes=1)
    assert ours.returncode == 0, ours.output[-3000:]
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "measure" / "trl_dpo_worker.py"), "--output-dir",
                           str(tmp_path / "trl"), *flags], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    theirs = [json.loads(line) for line in (tmp_path / "trl" / "metrics.jsonl").read_text().splitlines()]
    assert len(theirs) == len(ours.metrics()) == STEPS
    for step, (mine, trl) in enumerate(zip(ours.metrics(), theirs), 1):
        # (ORPO: trl.experimental's ORPOTrainer, its SFT term over the chosen rows' prompts too; its logps/* are
        # per-token means, the recipe's sums, so they are compared through the rewards: beta x the means)
        more = ("nll_loss", "log_odds_ratio", "log_odds_chosen") if loss == "orpo" else ("logps/chosen", "logps/rejected")
        for name in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", *more):
            assert mine[name] == pytest.approx(trl[name], abs=1e-4, rel=1e-4), (step, name, mine, trl)
    assert theirs[-1]["loss"] < theirs[0]["loss"]  # both trained: the comparison is not of two untrained models


@long_test  # ~25 s: the benchmark's plumbing (the figures are in results/, never asserted)
def test_the_speed_comparison_prints_both_sides_and_the_ratio(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "measure" / "compare_trl_dpo.py"), "--steps", "3", "--rounds", "1",
                           "--output-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert [line.split()[2] for line in lines if line.startswith("round ")] == ["ours", "TRL"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert lines[-1] == f"ratio: {summary['ratio']:.2f}" and summary["ratio"] > 0
