"""A run resumed from its checkpoint continues the uninterrupted run's loss curve exactly."""

from __future__ import annotations

import shutil

import pytest

from conftest import launch

ARGS = ["--max-steps", "8", "--save-every", "4", "--batch-size", "4", "--grad-accum", "2", "--lr", "5e-3"]


# DataLoader workers are the default on GPUs: their seeds must not shift the resumed run's dropout.
# (DDP without workers: tests/test_interruptions.py resumes it past a damaged checkpoint.)
@pytest.mark.parametrize("config, extra", [("fsdp", []), ("zero3", []), ("ddp", ["--dataloader-workers", "2"])],
                         ids=["fsdp", "zero3", "ddp-workers"])
def test_resume_continues_the_same_loss_curve(config, extra, tmp_path):
    whole = launch("lora", tmp_path / "whole", *ARGS, *extra, config=config)
    assert whole.returncode == 0, whole.output[-3000:]

    # The same run, stopped after step 4: only the step-4 checkpoint survives.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(whole.output_dir / "checkpoints" / "step-4", resumed_dir / "checkpoints" / "step-4")
    resumed = launch("lora", resumed_dir, *ARGS, *extra, "--resume", "auto", config=config)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "resumed from" in resumed.output

    steps = [record["step"] for record in resumed.metrics()]
    assert steps == [5, 6, 7, 8]
    assert resumed.losses() == whole.losses()[4:]


def test_a_second_run_into_the_same_folder_is_refused(tmp_path):
    first = launch("lora", tmp_path / "out", "--max-steps", "2", "--save-every", "2", config="ddp")
    assert first.returncode == 0, first.output[-3000:]
    second = launch("lora", tmp_path / "out", "--max-steps", "2", config="ddp")
    assert second.returncode != 0
    assert "already holds checkpoints of another run; pass --resume auto" in second.output


def test_a_fresh_run_does_not_mix_into_an_older_metrics_file(tmp_path):
    for steps in ("2", "3"):  # no checkpoints, so the second run is allowed and starts afresh
        run = launch("full", tmp_path / "out", "--max-steps", steps, "--batch-size", "4", "--lr", "1e-3")
        assert run.returncode == 0, run.output[-3000:]
    assert [record["step"] for record in run.metrics()] == [1, 2, 3]
