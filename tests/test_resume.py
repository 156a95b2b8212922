"""A run resumed from its checkpoint continues the uninterrupted run's loss curve exactly."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from conftest import REPO, launch

sys.path.insert(0, str(REPO / "recipes"))

ARGS = ["--max-steps", "8", "--save-every", "4", "--batch-size", "4", "--grad-accum", "2", "--lr", "5e-3"]


# FSDP2's and ZeRO-3's sharded checkpoints; DataLoader workers (the default on GPUs) must not shift
# the resumed run's dropout. DDP: tests/test_interruptions.py resumes it past a damaged checkpoint.
@pytest.mark.parametrize("config, extra", [("fsdp", ["--dataloader-workers", "2"]), ("zero3", [])],
                         ids=["fsdp-workers", "zero3"])
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


def test_a_fresh_run_does_not_mix_into_an_older_metrics_file(tmp_path):
    """A fresh run starts metrics.jsonl anew; a resumed one keeps the lines up to its checkpoint's step."""
    from types import SimpleNamespace

    from common.runlog import RunLog

    older = "".join(json.dumps({"type": "train", "step": step, "loss": 1.0}) + "\n" for step in range(1, 6))
    for first_step, kept in ((0, []), (3, [1, 2, 3])):
        (tmp_path / "metrics.jsonl").write_text(older)
        log = RunLog(SimpleNamespace(is_main_process=True), SimpleNamespace(output_dir=tmp_path, log_every=None), "lora")
        log.start(first_step=first_step, total_steps=8)
        log.metrics.close()
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == kept
