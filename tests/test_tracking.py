"""accelerate's trackers receive the same numbers as metrics.jsonl."""

from __future__ import annotations

import pytest

from conftest import launch


def test_tensorboard_gets_the_metrics_of_metrics_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = launch("lora", tmp_path / "out", "--max-steps", "4", "--eval-every", "2", "--batch-size", "2",
                 "--report-to", "tensorboard", config="ddp")
    assert run.returncode == 0, run.output[-3000:]
    logged = {}
    for event_file in (tmp_path / "out").rglob("events.out.tfevents*"):  # scalars, and the run's settings
        events = EventAccumulator(str(event_file))
        events.Reload()
        logged.update({tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]})

    for record in run.metrics("train"):
        assert logged["train/loss"][record["step"]] == pytest.approx(record["loss"], rel=1e-6)
        assert logged["train/lr"][record["step"]] == pytest.approx(record["lr"], rel=1e-6)
    evals = run.metrics("eval")
    assert [record["step"] for record in evals] == [2, 4]
    for record in evals:
        assert logged["eval/eval_exact_match"][record["step"]] == pytest.approx(record["eval_exact_match"], abs=1e-7)


def test_no_tracker_when_asked_for_none(tmp_path):
    run = launch("full", tmp_path / "out", "--max-steps", "1", "--report-to", "none")
    assert run.returncode == 0, run.output[-3000:]
    assert not list((tmp_path / "out").rglob("events.out.tfevents*"))
