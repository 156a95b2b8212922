"""A run resumed from its checkpoint continues the uninterrupted run's loss curve exactly."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from conftest import REPO, assert_the_refusal_ends_the_output, launch, long_test
from strategies import CPU_STRATEGIES, SAVE_EVERY, STEPS, matrix_args

sys.path.insert(0, str(REPO / "recipes"))

# FSDP2's and ZeRO-3's sharded checkpoints in every run, the other strategies as long tests. DDP with
# dropout and DataLoader workers: tests/test_interruptions.py resumes it past a damaged checkpoint.
@pytest.mark.parametrize("config", [pytest.param(config, marks=() if config in ("fsdp", "zero3") else long_test)
                                    for config in CPU_STRATEGIES])
def test_resume_continues_the_same_loss_curve(config, trained, tmp_path):
    whole = trained("lora", config)  # the matrix launch: 8 steps, a checkpoint every SAVE_EVERY
    assert whole.returncode == 0, whole.output[-3000:]

    # The same run, stopped after the first save: only that checkpoint survives.
    resumed_dir = tmp_path / "resumed"
    checkpoint = f"step-{SAVE_EVERY}"
    shutil.copytree(whole.output_dir / "checkpoints" / checkpoint, resumed_dir / "checkpoints" / checkpoint)
    resumed = launch("lora", resumed_dir, *matrix_args("lora", config), "--resume", "auto", config=config,
                     processes=CPU_STRATEGIES[config][1])
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"resumed from {resumed_dir / 'checkpoints' / checkpoint} at step {SAVE_EVERY}" in resumed.output

    steps = [record["step"] for record in resumed.metrics()]
    assert steps == list(range(SAVE_EVERY + 1, STEPS + 1))
    assert resumed.losses() == whole.losses()[SAVE_EVERY:]


def test_a_fresh_run_does_not_mix_into_an_older_metrics_file(tmp_path):
    """A fresh run starts metrics.jsonl anew; a resumed one keeps the lines up to its checkpoint's step."""
    from types import SimpleNamespace

    from common.outputs.runlog import RunLog

    older = "".join(json.dumps({"type": "train", "step": step, "loss": 1.0}) + "\n" for step in range(1, 6))
    for first_step, kept in ((0, []), (3, [1, 2, 3])):
        (tmp_path / "metrics.jsonl").write_text(older)
        log = RunLog(SimpleNamespace(is_main_process=True), SimpleNamespace(output_dir=tmp_path, log_every=None), "lora", None)
        log.start(first_step=first_step, total_steps=8)
        log.metrics.close()
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == kept


def one_process_args(config: str) -> list[str]:
    """The matrix launch's flags for one process with the same global batch: twice the micro-batch."""
    args = matrix_args("lora", config)
    at = args.index("--batch-size") + 1
    return args[:at] + [str(int(args[at]) * CPU_STRATEGIES[config][1])] + args[at + 1:]


@pytest.mark.parametrize("config", ["ddp", pytest.param("fsdp", marks=long_test)])
def test_a_checkpoint_continues_on_fewer_processes_on_the_same_curve(config, trained, tmp_path):
    """DDP's and FSDP2's checkpoints load at another process count; with the same global batch each step
    takes the rows it took before (the shuffle is over the global batch), so the curve continues."""
    whole = trained("lora", config)
    assert whole.returncode == 0, whole.output[-3000:]
    checkpoint = f"step-{SAVE_EVERY}"
    shutil.copytree(whole.output_dir / "checkpoints" / checkpoint, tmp_path / "checkpoints" / checkpoint)
    resumed = launch("lora", tmp_path, *one_process_args(config), "--resume", "auto", config=config, processes=1)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"was written by 2 processes and resumes on 1" in resumed.output
    assert resumed.losses() == pytest.approx(whole.losses()[SAVE_EVERY:], rel=1e-6)


@pytest.mark.parametrize("written, config, processes, refusal", [
    ("zero3", "zero3", 1, "was written by DeepSpeed on 2 processes, which splits its optimizer state over them; "
                          "resume it on 2 (--num_processes 2), or start in a new --output-dir"),
    ("fsdp", "ddp", 2, "was written by an FSDP config (fsdp*.yaml) and this launch is ddp.yaml, model_parallel.yaml "
                       "or one process: a checkpoint continues under the kind of strategy that wrote it; launch with "
                       "that config, or start in a new --output-dir"),
])
def test_what_cannot_continue_is_refused_in_one_line(written, config, processes, refusal, trained, tmp_path):
    """A checkpoint another kind of strategy wrote, or DeepSpeed's on another process count, stops in one line
    before the model loads (each was a traceback from the loading)."""
    whole = trained("lora", written)
    assert whole.returncode == 0, whole.output[-3000:]
    checkpoint = tmp_path / "checkpoints" / f"step-{SAVE_EVERY}"
    shutil.copytree(whole.output_dir / "checkpoints" / checkpoint.name, checkpoint)
    args = matrix_args("lora", config) if processes == 2 else one_process_args(config)
    resumed = launch("lora", tmp_path, *args, "--resume", "auto", config=config, processes=processes)
    assert resumed.returncode != 0
    assert_the_refusal_ends_the_output(resumed.output, f"error: {checkpoint} {refusal}")
    assert "Loading weights" not in resumed.output  # refused before the model loads
