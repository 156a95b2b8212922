"""Interrupted runs lose nothing: damaged checkpoints are skipped, a killed rank restarts the job by
itself, Ctrl-C checkpoints and stops; each continues the uninterrupted run's loss curve."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

from conftest import assert_no_traceback_of_ours, launch, long_test, start

ARGS = ["--max-steps", "8", "--save-every", "2", "--save-total-limit", "2", "--batch-size", "2", "--lr", "5e-3"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run the others are compared with."""
    run = launch("lora", tmp_path_factory.mktemp("whole") / "out", *ARGS, config="ddp")
    assert run.returncode == 0, run.output[-3000:]
    return run


def steps_of(run) -> list[int]:
    return [record["step"] for record in run.metrics()]


def test_the_newest_checkpoints_are_kept_and_the_output_is_quiet(whole):
    assert sorted(p.name for p in (whole.output_dir / "checkpoints").iterdir()) == ["step-6", "step-8"]
    assert steps_of(whole) == list(range(1, 9))
    assert "Setting accelerator to CPU" not in whole.output  # DeepSpeed's notice, printed by every DDP rank before
    # the libraries' bars (loading weights, tokenising) left out: one line for the wait instead
    assert "it/s]" not in whole.output and "examples/s]" not in whole.output, whole.output[:3000]
    assert whole.output.count("model: loading the weights of ") == 1
    # no terminal here, so no progress bar: a line per step instead
    assert [line.split(":")[0] for line in whole.output.splitlines() if line.startswith("step ")] == [
        f"step {n}" for n in range(1, 9)]


def test_a_damaged_checkpoint_is_skipped_and_the_curve_continues_once(whole, tmp_path):
    output_dir = tmp_path / "out"
    shutil.copytree(whole.output_dir, output_dir)
    weights = sorted((output_dir / "checkpoints" / "step-8").rglob("*.safetensors"))[0]
    weights.write_bytes(weights.read_bytes()[:-100])  # e.g. a disk that filled up during the copy
    # with DataLoader workers (the default on GPUs), which the uninterrupted run had not: they give the
    # same batches and must not shift the resumed run's dropout draws
    resumed = launch("lora", output_dir, *ARGS, "--dataloader-workers", "2", "--resume", "auto", config="ddp")
    assert resumed.returncode == 0, resumed.output[-3000:]
    damaged = [line for line in resumed.output.splitlines() if line.startswith("skipping damaged checkpoint")]
    assert len(damaged) == 1 and f"{weights.relative_to(output_dir / 'checkpoints' / 'step-8')} has" in damaged[0]
    assert f"resumed from {output_dir / 'checkpoints' / 'step-6'} at step 6" in resumed.output
    assert steps_of(resumed) == list(range(1, 9))  # steps 7 and 8 once, from the resumed run
    assert resumed.losses() == whole.losses()


def test_a_second_run_into_the_same_folder_is_refused(whole, tmp_path):
    output_dir = tmp_path / "out"
    shutil.copytree(whole.output_dir, output_dir)
    second = launch("lora", output_dir, "--max-steps", "2", config="ddp")
    assert second.returncode != 0
    errors = [line for line in second.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "already holds checkpoints of another run; pass --resume auto" in errors[0], errors
    assert "model: loading the weights" not in second.output
    assert_no_traceback_of_ours(second.output)


# Imported by every process of the launch (PYTHONPATH): the main rank kills itself (kill -9) right after it
# renames a checkpoint into place, in the first attempt only. Polling for the folder from outside raced
# the job's last second and could find it already finished.
KILL_AFTER_CHECKPOINT = """
import os, pathlib, signal
if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    _rename = pathlib.Path.rename
    def rename(self, target):
        moved = _rename(self, target)
        if pathlib.Path(target).name == os.environ["KILL_AFTER_CHECKPOINT"]:
            os.kill(os.getpid(), signal.SIGKILL)
        return moved
    pathlib.Path.rename = rename
"""


@long_test
def test_a_killed_rank_restarts_the_job_from_its_checkpoint(whole, tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_AFTER_CHECKPOINT)
    output_dir = tmp_path / "out"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])),
           "KILL_AFTER_CHECKPOINT": "step-4"}
    job = start("lora", output_dir, *ARGS, config="ddp", launcher_args=("--max_restarts", "1"), env=env)
    output, _ = job.communicate(timeout=600)
    assert job.returncode == 0, output[-3000:]
    assert "restart 1 (accelerate launch --max_restarts): continuing from the newest intact checkpoint" in output
    assert f"resumed from {output_dir / 'checkpoints' / 'step-4'} at step 4" in output, output[-3000:]
    restarted = type(whole)(job.returncode, output, output_dir)
    assert steps_of(restarted) == list(range(1, 9))
    assert restarted.losses() == whole.losses()


@pytest.mark.parametrize("config, extra", [("ddp", []), pytest.param("fsdp", [], marks=long_test),
                                           pytest.param("zero3", [], marks=long_test),
                                           pytest.param("ddp", ["--pipeline-stages", "2", "--grad-accum", "2"], marks=long_test)])
def test_ctrl_c_checkpoints_at_the_step_and_stops_with_one_line(whole, tmp_path, config, extra):
    """Named Ctrl-C on every strategy (the launcher passes it on to each rank)."""
    output_dir = tmp_path / "out"
    job = start("lora", output_dir, *ARGS[:1], "100000", *ARGS[2:], *extra, config=config, terminal=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (output_dir / "metrics.jsonl").exists():
        time.sleep(0.2)
    while time.time() < deadline and len((output_dir / "metrics.jsonl").read_text().splitlines()) < 3:
        time.sleep(0.2)
    os.killpg(job.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the launcher and every rank
    output, _ = job.communicate(timeout=120)
    stops = [line for line in output.splitlines() if line.startswith("stopped by ")]
    assert len(stops) == 1 and stops[0].startswith("stopped by Ctrl-C after step "), output[-3000:]
    step = int(stops[0].split("after step ")[1].split(";")[0])
    assert (output_dir / "checkpoints" / f"step-{step}" / "recipe_state.json").is_file()
    assert_no_traceback_of_ours(output)
    assert "KeyboardInterrupt" not in output


# Imported by every process of the second machine (PYTHONPATH): once its rank sees the checkpoint folder it
# names, in the first attempt only, the whole machine goes (kill -9 of its launcher and its rank).
LOSE_MACHINE_AFTER_CHECKPOINT = """
import os, pathlib, signal, threading, time
if os.environ.get("RANK") is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    def watch(folder=pathlib.Path(os.environ["LOSE_MACHINE_AFTER_CHECKPOINT"])):
        while not folder.is_dir():
            time.sleep(0.02)
        os.kill(os.getppid(), signal.SIGKILL)  # the machine's launcher, then this rank
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, daemon=True).start()
"""


@long_test  # two launchers, a lost machine and a new rendezvous (~60 s)
def test_an_elastic_job_that_loses_a_machine_continues_the_curve_on_the_one_left(whole, tmp_path):
    """torchrun --nnodes 1:2 --max-restarts: the second machine dies after step 4's checkpoint; the first restarts
    alone, resumes with --resume auto (on the elastic restart) from the newest checkpoint, and --global-batch-size
    keeps each step's rows: the uninterrupted two-process curve."""
    import subprocess
    import sys

    from conftest import REPO, free_port, launch_env

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(LOSE_MACHINE_AFTER_CHECKPOINT)
    output_dir = tmp_path / "out"
    port = str(free_port())
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
               "--rdzv-conf", "last_call_timeout=10", "--max-restarts", "2", str(REPO / "recipes" / "lora.py"),
               "--output-dir", str(output_dir), *ARGS, "--global-batch-size", "4"]
    machines = []
    for lost in (False, True):  # the first hosts the rendezvous: the one that stays
        env = {"LOSE_MACHINE_AFTER_CHECKPOINT": str(output_dir / "checkpoints" / "step-4"),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))} if lost else {}
        machines.append(subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True, env=launch_env(env), start_new_session=True))
        time.sleep(2)
    output, _ = machines[0].communicate(timeout=600)
    machines[1].communicate(timeout=60)
    assert machines[0].returncode == 0, output[-3000:]
    assert machines[1].returncode == -signal.SIGKILL
    assert "restart 1 (torchrun --max-restarts): continuing from the newest intact checkpoint" in output
    assert "was written by 2 processes and resumes on 1 with the same global batch" in output, output[-3000:]
    restarted = type(whole)(0, output, output_dir)
    assert steps_of(restarted) == list(range(1, 9))
    assert restarted.losses() == pytest.approx(whole.losses(), rel=1e-5)
