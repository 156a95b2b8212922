"""scripts/plot.py (curves of several runs in one PNG) and scripts/slurm/train.sbatch (multi-node
launch, pre-emption and requeue), both without training and without SLURM.

The sbatch script runs with fake `scontrol`, `srun` and `scancel` first on PATH and `ACCELERATE`
standing for the `accelerate` command. The pre-emption test runs the real `accelerate launch` on
two fake nodes with a stand-in training script that saves slowly on SIGTERM (a few seconds).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CONFIGS, REPO, free_port

PLOT = REPO / "scripts" / "plot.py"
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def load_plot_module():
    spec = importlib.util.spec_from_file_location("plot_script", PLOT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def write_run(folder: Path, losses: list[float], evals: dict[int, tuple[float, float]],
              run_json: dict | None = None, restart_at: int | None = None) -> Path:
    """A metrics.jsonl as recipes/common/outputs/runlog.py writes it (and run.json when given).

    With `restart_at`, the process stops after the last step and a second one resumes from the
    checkpoint of step `restart_at`: steps after it are logged again, elapsed_s and tokens_seen
    restart from zero, as a real `--resume auto` does.
    """
    folder.mkdir(parents=True)
    lines, tokens_seen, elapsed = [], 0, 0.0

    def train(step, loss):
        nonlocal tokens_seen, elapsed
        tokens_seen += 100
        elapsed += 0.5
        lines.append({"type": "train", "step": step, "epoch": 0, "loss": loss, "lr": 1e-3, "grad_norm": 1.0,
                      "tokens": 100, "tokens_seen": tokens_seen, "elapsed_s": elapsed,
                      "tokens_per_s": tokens_seen / elapsed})

    for step, loss in enumerate(losses, start=1):
        train(step, loss)
        if step in evals:
            lines.append({"type": "eval", "step": step,
                          "eval_loss": evals[step][0], "eval_exact_match": evals[step][1]})
    text = "".join(json.dumps(line) + "\n" for line in lines)
    if restart_at is not None:
        text += '{"type": "train", "step": 99, "lo\n'  # a line cut short by the crash
        lines, tokens_seen, elapsed = [], 0, 0.0
        for step in range(restart_at + 1, len(losses) + 1):
            train(step, losses[step - 1] - 0.01)
        text += "".join(json.dumps(line) + "\n" for line in lines)
    (folder / "metrics.jsonl").write_text(text)
    if run_json is not None:
        (folder / "run.json").write_text(json.dumps({"recipe": "lora", **run_json}))
    return folder


def run_plot(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PLOT), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG header, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.fixture
def two_runs(tmp_path):
    losses = [3.0 - 0.1 * i for i in range(12)]
    ddp = write_run(tmp_path / "outputs" / "ddp", losses, {6: (2.6, 0.25), 12: (2.1, 0.5)},
                    {"distributed_type": "MULTI_GPU", "num_processes": 4})
    fsdp = write_run(tmp_path / "outputs" / "fsdp", losses, {6: (2.65, 0.2), 12: (2.15, 0.45)},
                     {"distributed_type": "FSDP", "num_processes": 8}, restart_at=8)
    return ddp, fsdp


# ---------------------------------------------------------------------------------------------
# scripts/plot.py


def test_plot_draws_two_runs_in_one_png_labelled_from_run_json(two_runs, tmp_path):
    done = run_plot("outputs/ddp", "outputs/fsdp/metrics.jsonl", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    image = tmp_path / "curves.png"  # the default output, in the current folder
    assert "wrote curves.png (2 run(s), x = step)" in done.stdout
    assert "outputs/ddp (MULTI_GPU x 4): 12 step(s)" in done.stdout
    assert "outputs/fsdp (FSDP x 8): 12 step(s)" in done.stdout

    width, height = png_size(image)
    assert 1000 <= width <= 2500 and 300 <= height <= 1200, (width, height)
    import matplotlib.image

    pixels = matplotlib.image.imread(image)
    assert pixels.shape[:2] == (height, width)
    assert pixels[..., :3].std() > 0.05  # not a blank canvas


def test_plot_labels_option_other_axes_and_output_path(two_runs, tmp_path):
    for axis in ("tokens", "time"):
        done = run_plot("outputs/ddp", "outputs/fsdp", "--labels", "ddp,fsdp", "--x", axis,
                        "--output", f"plots/{axis}.png", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[:2] == [
            "ddp: 12 step(s), last loss 1.9000, at step 12: eval_loss 2.1000, eval_exact_match 0.5000",
            "fsdp: 12 step(s), last loss 1.8900, at step 12: eval_loss 2.1500, eval_exact_match 0.4500",
        ]
        assert png_size(tmp_path / "plots" / f"{axis}.png")[0] > 1000


def test_plot_reads_resumed_runs_and_labels(two_runs):
    plot = load_plot_module()
    ddp, fsdp = two_runs
    assert plot.default_label(ddp / "metrics.jsonl") == f"{ddp} (MULTI_GPU x 4)"
    run = plot.read_run(fsdp / "metrics.jsonl", "fsdp")
    # Steps 9-12 were logged twice (before the stop and after the resume from step 8): the later
    # records win, the cut line is skipped, and tokens / time add up over the two processes.
    assert [r["step"] for r in run.train] == list(range(1, 13))
    assert run.train[-1]["loss"] == pytest.approx(1.89)
    assert run.x_of_steps("step")[12] == 12
    assert run.x_of_steps("tokens")[12] == pytest.approx(1200)
    assert run.x_of_steps("time")[12] == pytest.approx(6.0)
    assert [r["step"] for r in run.evals] == [6, 12]

    no_run_json = write_run(ddp.parent / "plain", [1.0, 0.9], {})
    assert plot.default_label(no_run_json / "metrics.jsonl") == str(no_run_json)


@pytest.mark.parametrize("case", ["missing folder", "folder without metrics", "empty metrics", "label count"])
def test_plot_errors_are_one_line_exit_2(case, two_runs, tmp_path):
    (tmp_path / "outputs" / "empty").mkdir()
    (tmp_path / "outputs" / "blank").mkdir()
    (tmp_path / "outputs" / "blank" / "metrics.jsonl").write_text("\n")
    args = {"missing folder": ["outputs/ddp", "outputs/nope"],
            "folder without metrics": ["outputs/empty"],
            "empty metrics": ["outputs/blank"],
            "label count": ["outputs/ddp", "outputs/fsdp", "--labels", "only-one"]}[case]
    done = run_plot(*args, cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "curves.png").exists()


def test_plot_help():
    done = subprocess.run([sys.executable, str(PLOT), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for option in ("--labels", "--output", "--x"):
        assert option in done.stdout


# ---------------------------------------------------------------------------------------------
# scripts/slurm/train.sbatch

FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_OUT/calls"
if [ "$1 $2" = "show hostnames" ]; then printf '%s\\n' $FAKE_HOSTS; fi
"""

# One task, as on the node the test plays (SLURM_NODEID comes from the test's environment).
FAKE_SRUN_ONE_NODE = """#!/bin/bash
echo "srun $*" >> "$FAKE_OUT/calls"
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
exec "$@"
"""

# One task per node, each in its own session with its own SLURM_NODEID, as slurmstepd starts them.
FAKE_SRUN_ALL_NODES = """#!/bin/bash
echo "srun $*" >> "$FAKE_OUT/calls"
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
pids=()
for (( node = 0; node < SLURM_NNODES; node++ )); do
    SLURM_NODEID=$node SLURM_PROCID=$node setsid "$@" &
    pids+=($!)
    echo $! >> "$FAKE_OUT/tasks"
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""

# `scancel --signal=TERM <job>`: SIGTERM to the tasks of every step (not to the batch shell).
FAKE_SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$FAKE_OUT/calls"
while read -r task; do kill -TERM -- "-$task" 2>/dev/null; done < "$FAKE_OUT/tasks"
"""

# Stands in for a recipe: on SIGTERM it finishes its "step", then takes 2 s to "checkpoint" (longer
# than the launcher's shutdown timeout in the test), then exits 0.
FAKE_RECIPE = """import os, signal, sys, time
from pathlib import Path
out = Path(os.environ["FAKE_OUT"])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
rank = os.environ["RANK"]
(out / f"ready-{rank}").write_text(" ".join(sys.argv[1:]))
while not stop:
    time.sleep(0.05)
time.sleep(2)
(out / f"saved-{rank}").write_text("checkpoint")
"""


def fake_slurm(tmp_path: Path, srun: str) -> tuple[Path, dict]:
    bin_dir, out = tmp_path / "bin", tmp_path / "fake"
    bin_dir.mkdir()
    out.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", srun), ("scancel", FAKE_SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (out / "tasks").touch()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "PET_"))}
    env.update({"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "FAKE_OUT": str(out), "FAKE_HOSTS": "gpu-a17 gpu-a18",
                "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-a[17-18]", "SLURM_NNODES": "2"})
    return out, env


def test_sbatch_parses_and_keeps_site_lines_commented():
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True).returncode == 0
    directives = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --requeue" in directives
    assert any(line.startswith("#SBATCH --signal=B:TERM@") for line in directives)
    assert not any(key in line for line in directives for key in ("--partition", "--account", "--qos"))


def test_sbatch_dry_run_builds_the_accelerate_command(tmp_path):
    out, env = fake_slurm(tmp_path, FAKE_SRUN_ONE_NODE)
    env.update({"SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "4", "ACCELERATE": "echo accelerate"})
    done = subprocess.run(["bash", str(SBATCH), "accelerate_configs/fsdp.yaml", "recipes/lora.py",
                           "--model", "some/model", "--output-dir", "outputs/two nodes"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    launches = [line for line in done.stdout.splitlines() if line.startswith("accelerate launch")]
    assert len(launches) == 1, done.stdout
    words = launches[0].split()
    assert words[words.index("--machine_rank") + 1] == "1"
    assert words[words.index("--num_machines") + 1] == "2"
    assert words[words.index("--num_processes") + 1] == "8"
    assert words[words.index("--main_process_ip") + 1] == "gpu-a17"
    assert words[words.index("--config_file") + 1] == "accelerate_configs/fsdp.yaml"
    assert words[words.index("--rdzv_backend") + 1] == "static"
    assert "--same_network" in words
    # accelerate's options come before the recipe, the recipe's after it, --resume auto last
    assert words.index("--main_process_port") < words.index("recipes/lora.py") < words.index("--model")
    assert launches[0].endswith("recipes/lora.py --model some/model --output-dir outputs/two nodes --resume auto")

    calls = (out / "calls").read_text()
    assert "scontrol show hostnames gpu-a[17-18]" in calls
    assert "srun --nodes=2 --ntasks-per-node=1" in calls
    assert "requeue" not in calls and "scancel" not in calls  # no SIGTERM, no requeue


def test_sbatch_gpu_count_fallbacks_and_refusals(tmp_path):
    out, env = fake_slurm(tmp_path, FAKE_SRUN_ONE_NODE)
    nvidia_smi = out.parent / "bin" / "nvidia-smi"  # what `nvidia-smi -L` lists: GPUs, and MIG slices of them
    nvidia_smi.write_text('#!/bin/bash\nprintf "%b" "$FAKE_GPUS"\n')
    nvidia_smi.chmod(0o755)
    env.update({"SLURM_NODEID": "0", "ACCELERATE": "echo accelerate",
                "FAKE_GPUS": "GPU 0: NVIDIA H100 (UUID: a)\\n  MIG 3g.40gb Device 0: (UUID: b)\\n"
                             "GPU 1: NVIDIA H100 (UUID: c)\\n"})

    def sbatch(*args, **extra_env):
        return subprocess.run(["bash", str(SBATCH), *args], cwd=REPO, env={**env, **extra_env},
                              capture_output=True, text=True, timeout=60)

    done = sbatch("accelerate_configs/ddp.yaml", "recipes/full.py")  # no SLURM_GPUS_ON_NODE: nvidia-smi -L
    assert done.returncode == 0, done.stderr
    assert "--machine_rank 0 " in done.stdout and "--num_processes 4 " in done.stdout
    done = sbatch("accelerate_configs/ddp.yaml", "recipes/full.py", GPUS_PER_NODE="3", SLURM_GPUS_ON_NODE="8")
    assert "--num_processes 6 " in done.stdout

    done = sbatch("accelerate_configs/ddp.yaml", "recipes/full.py", FAKE_GPUS="")
    assert done.returncode == 2 and "no GPU found" in done.stderr
    assert "srun" not in (out / "calls").read_text().splitlines()[-1]

    done = sbatch("accelerate_configs/ddp.yaml")
    assert done.returncode == 2 and done.stderr.startswith("usage: sbatch")


def test_sbatch_sigterm_checkpoints_on_every_node_then_requeues(tmp_path):
    """SLURM's warning signal (to the batch shell) reaches the training processes of both nodes
    through `scancel --signal=TERM`; `accelerate launch` does not kill them while they save; the
    job ends with status 0 and asks to be requeued."""
    out, env = fake_slurm(tmp_path, FAKE_SRUN_ALL_NODES)
    recipe = tmp_path / "fake_recipe.py"
    recipe.write_text(FAKE_RECIPE)
    env.update({"FAKE_HOSTS": "127.0.0.1", "SLURM_GPUS_ON_NODE": "1", "MAIN_PROCESS_PORT": str(free_port()),
                "LAUNCH_ARGS": "--mixed_precision no",
                "ACCELERATE": f"{sys.executable} -m accelerate.commands.accelerate_cli",
                # torch's launcher would SIGKILL the training processes 1 s after acting on SIGTERM
                "PET_SHUTDOWN_TIMEOUT": "1", "PYTHONUNBUFFERED": "1"})
    batch = subprocess.Popen(["bash", str(SBATCH), str(CONFIGS / "ddp.yaml"), str(recipe), "--max-steps", "5"],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not all((out / f"ready-{rank}").exists() for rank in ("0", "1")):
            assert batch.poll() is None, batch.communicate()[0]
            assert time.monotonic() < deadline, "the training processes did not start"
            time.sleep(0.2)
        assert (out / "ready-1").read_text() == "--max-steps 5 --resume auto"
        batch.send_signal(signal.SIGTERM)  # what --signal=B:TERM@120 sends
        output = batch.communicate(timeout=120)[0]
    finally:
        for task in (out / "tasks").read_text().split():
            try:
                os.killpg(int(task), signal.SIGKILL)
            except ProcessLookupError:
                pass
        if batch.poll() is None:
            os.killpg(batch.pid, signal.SIGKILL)
            batch.wait()
    assert batch.returncode == 0, output
    assert (out / "saved-0").exists() and (out / "saved-1").exists(), output
    calls = (out / "calls").read_text().splitlines()
    assert "scancel --signal=TERM 4242" in calls
    assert calls[-1] == "scontrol requeue 4242"
    assert "requeueing job 4242" in output
