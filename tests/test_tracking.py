"""accelerate's trackers receive the same numbers as metrics.jsonl; `--report-to none` writes none;
no token reaches what a run prints or writes."""

from __future__ import annotations

import pytest

from conftest import launch

SECRET = "hf_SECRETtoken1234567890"


def test_tensorboard_gets_the_metrics_of_metrics_jsonl(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = trained("lora", "ddp")  # --report-to auto: TensorBoard, installed here
    assert run.returncode == 0, run.output[-3000:]
    logged = {}
    event_files = list(run.output_dir.rglob("events.out.tfevents*"))
    assert event_files
    for event_file in event_files:  # scalars, and the run's settings
        events = EventAccumulator(str(event_file))
        events.Reload()
        logged.update({tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]})

    train = run.metrics("train")
    assert [record["step"] for record in train] == sorted(logged["train/loss"])
    for record in train:
        assert logged["train/loss"][record["step"]] == pytest.approx(record["loss"], rel=1e-6)
        assert logged["train/lr"][record["step"]] == pytest.approx(record["lr"], rel=1e-6)
    evals = run.metrics("eval")
    assert evals and [record["step"] for record in evals] == sorted(logged["eval/eval_exact_match"])
    for record in evals:
        assert logged["eval/eval_exact_match"][record["step"]] == pytest.approx(record["eval_exact_match"], abs=1e-7)


@pytest.fixture(scope="module")
def untracked(tmp_path_factory):
    """A run with --report-to none (given in a --config file) and tokens in its environment."""
    folder = tmp_path_factory.mktemp("untracked")
    (folder / "run.yaml").write_text("max-steps: 2\nbatch-size: 2\neval-every: 1\nreport-to: none\n")
    run = launch("lora", folder / "out", "--config", str(folder / "run.yaml"), config="ddp",
                 env={"HF_TOKEN": SECRET, "HUGGING_FACE_HUB_TOKEN": SECRET, "WANDB_API_KEY": SECRET})
    assert run.returncode == 0, run.output[-3000:]
    assert run.run_json()["arguments"]["report_to"] == "none" and len(run.metrics()) == 2
    return run


def test_no_tracker_when_asked_for_none(untracked):
    assert (untracked.output_dir / "metrics.jsonl").is_file()
    assert not list(untracked.output_dir.rglob("events.out.tfevents*"))


def test_no_token_reaches_logs_or_outputs(untracked):
    assert SECRET not in untracked.output
    for path in untracked.output_dir.rglob("*"):
        if path.is_file() and path.stat().st_size < 5_000_000:
            assert SECRET.encode() not in path.read_bytes(), path
