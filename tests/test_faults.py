"""Faults lose nothing: pre-emption checkpoints and stops cleanly; a diverged loss stops the run."""

from __future__ import annotations

import signal
import subprocess
import time

from conftest import launch, long_test, start


@long_test  # ~30 s; every run sends Ctrl-C instead (test_interruptions.py), which StepSync handles alike
def test_sigterm_checkpoints_and_the_run_resumes(tmp_path):
    output_dir = tmp_path / "out"
    job = start_training(output_dir, "--max-steps", "100000")
    wait_for_steps(output_dir, 5)
    job.send_signal(signal.SIGTERM)  # what SLURM sends to a pre-empted job
    output, _ = job.communicate(timeout=120)

    assert "stopped by SIGTERM after step" in output, output[-3000:]
    checkpoints = sorted((output_dir / "checkpoints").glob("step-*"))
    assert len(checkpoints) == 1 and (checkpoints[0] / "recipe_state.json").is_file()
    stopped_at = int(checkpoints[0].name.split("-")[1])
    assert stopped_at >= 5

    resumed = launch("lora", output_dir, "--max-steps", str(stopped_at + 2), "--batch-size", "2",
                     "--resume", "auto", config="ddp")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"resumed from {checkpoints[0]} at step {stopped_at}" in resumed.output
    assert [r["step"] for r in resumed.metrics()][-2:] == [stopped_at + 1, stopped_at + 2]


def test_a_diverging_loss_stops_the_run_with_one_line(tmp_path):
    run = launch("full", tmp_path / "out", "--lr", "1e12", "--max-grad-norm", "1e30", "--max-steps", "50",
                 "--save-every", "1", "--batch-size", "4", config="ddp")
    assert run.returncode != 0
    lines = [line for line in run.output.splitlines() if line.startswith("error: the loss became")]
    assert len(lines) == 1, run.output[-3000:]
    bad_step = int(lines[0].split(" at step ")[1].split(";")[0])
    # Every checkpoint kept is from before the divergence, and none is half-written.
    steps = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out" / "checkpoints").glob("step-*"))
    assert steps == list(range(1, bad_step))
    assert not list((tmp_path / "out" / "checkpoints").glob(".*partial"))


def start_training(output_dir, *extra, env=None) -> subprocess.Popen:
    return start("lora", output_dir, "--batch-size", "2", "--log-every", "0", *extra, config="ddp", env=env)


def wait_for_steps(output_dir, steps: int, limit_s: float = 180) -> None:
    metrics = output_dir / "metrics.jsonl"
    deadline = time.time() + limit_s
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        time.sleep(0.5)


def test_killing_one_rank_ends_the_whole_job_quickly(tmp_path):
    import psutil

    job = start_training(tmp_path / "out", "--max-steps", "100000")
    wait_for_steps(tmp_path / "out", 5)
    workers = [p for p in psutil.Process(job.pid).children(recursive=True) if "recipes/lora.py" in " ".join(p.cmdline())]
    assert len(workers) == 2
    killed_at = time.time()
    workers[1].kill()  # kill -9 of one rank in the middle of training
    job.communicate(timeout=120)
    assert job.returncode != 0
    assert time.time() - killed_at < 60
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)


def test_a_kill_while_saving_leaves_the_previous_checkpoint_as_the_newest(tmp_path):
    output_dir = tmp_path / "out"
    job = start_training(output_dir, "--max-steps", "6", "--save-every", "2",
                         env={"RECIPES_TEST_KILL_DURING_SAVE": "4"})
    output, _ = job.communicate(timeout=300)
    assert job.returncode != 0, output[-3000:]
    folder = output_dir / "checkpoints"
    assert (folder / "step-2" / "recipe_state.json").is_file()
    assert not (folder / "step-4").exists() and (folder / ".step-4.partial").exists()

    resumed = launch("lora", output_dir, "--max-steps", "6", "--save-every", "2", "--batch-size", "2",
                     "--resume", "auto", config="ddp")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"resumed from {folder / 'step-2'} at step 2" in resumed.output
    assert (folder / "step-4" / "recipe_state.json").is_file() and not (folder / ".step-4.partial").exists()
