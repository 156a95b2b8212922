"""The launches: the `accelerate launch` command of a strategy, as run and as shown, and one strategy's run
from its launch to its row of results.json."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu_monitor import GpuSampler, LaunchMonitor
from bench.paths import CONFIGS, REPO
from bench.row import (
    failure_message,
    launch_row,
    measurements,
    planned_peak_gib,
    progress_line,
    read_metrics,
    scaled_estimate,
    tokens_per_s_per_gpu,
)
from bench.timing import summarise_metrics
from bench.workloads import STRATEGIES, Strategy, Workload


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(strategy: Strategy, processes: int, model: Path, data: Path, output: Path, workload: Workload,
                   batch_size: int, grad_accum: int, smoke: bool, gradient_checkpointing: bool,
                   port: int | None = None, python: str = sys.executable, recipe_args: tuple = ()) -> list[str]:
    command = [python, "-m", "accelerate.commands.launch", "--config_file",
               str(CONFIGS / f"{strategy.config}.yaml"), "--num_processes", str(processes)]
    if port is not None and processes > 1:
        command += ["--main_process_port", str(port)]
    if smoke:
        command += ["--mixed_precision", "no"]
    command += [str(REPO / "recipes" / f"{strategy.recipe}.py"), "--model", str(model), "--dataset", str(data),
                "--output-dir", str(output), "--epochs", "1", "--max-length", str(workload.max_length),
                "--batch-size", str(batch_size), "--grad-accum", str(grad_accum),
                "--report-to", "none", "--log-every", "0", "--eval-every", "0"]
    if gradient_checkpointing:
        command.append("--gradient-checkpointing")
    return command + list(recipe_args)


def shell_line(command: list[str]) -> str:
    """The command as a person would type it: `accelerate launch ...`, paths relative to the repository."""
    words = list(command)
    if words[:3] == [sys.executable, "-m", "accelerate.commands.launch"]:
        words = ["accelerate", "launch"] + words[3:]
    out = []
    for word in words:
        try:
            word = str(Path(word).relative_to(REPO)) if word.startswith(str(REPO)) else word
        except ValueError:
            pass
        out.append(word)
    return " ".join(out)


def dry_run_commands(names: list[str], settings: dict) -> list[str]:
    """The shell line of each strategy's launch, as the run would make it (no port: none is reserved)."""
    lines = []
    for name in names:
        strategy = STRATEGIES[name]
        processes = 1 if name == "model_parallel" else settings["devices"]
        output = settings["runs"] / settings["workload"].name / name
        lines.append(shell_line(launch_command(strategy, processes, settings["model"], settings["data"], output,
                                               settings["workload"], settings["batch_size"], settings["grad_accum"],
                                               settings["smoke"], settings["gradient_checkpointing"],
                                               recipe_args=settings["recipe_args"])))
    return lines


def launch_and_wait(command: list[str], log_path: Path, env: dict, timeout: float):
    """Run the launch with its output in `log_path`; its exit status, or "timeout" when it was stopped."""
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            return process.wait(timeout=timeout or None)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            return "timeout"


def run_strategy(strategy: Strategy, settings: dict, env: dict, sampler_ids: list[str], log) -> dict:
    """Launch one strategy, wait, and turn its metrics.jsonl into a row of results.json."""
    output = settings["runs"] / settings["workload"].name / strategy.name
    if output.exists():
        shutil.rmtree(output)  # a fresh run: no stale metrics, and the recipe refuses foreign checkpoints
    output.mkdir(parents=True)
    processes = 1 if strategy.name == "model_parallel" else settings["devices"]
    # Model parallel spreads one process over every GPU; on CPU (smoke) it is one process on one core.
    devices = processes if settings["smoke"] else settings["devices"]
    command = launch_command(strategy, processes, settings["model"], settings["data"], output,
                             settings["workload"], settings["batch_size"], settings["grad_accum"],
                             settings["smoke"], settings["gradient_checkpointing"], port=free_port(),
                             recipe_args=settings["recipe_args"])
    row = launch_row(strategy, settings, processes, devices, shell_line(command), output)
    log(f"[{strategy.name}] {row['command']}")
    sampler = GpuSampler(sampler_ids) if sampler_ids else None
    monitor = LaunchMonitor(sampler, output / "metrics.jsonl")
    monitor.start()
    started = time.perf_counter()
    returncode = launch_and_wait(command, output / "launch.log", env, settings["timeout"])
    row["end_to_end_s"] = round(time.perf_counter() - started, 3)  # from the launch to the adapter saved
    monitor.stop()
    if returncode != 0:
        row.update(status="failed", error=failure_message(output / "launch.log", returncode))
        log(f"[{strategy.name}] FAILED ({row['error']}); log: {output / 'launch.log'}")
        return row
    summary = summarise_metrics(read_metrics(output / "metrics.jsonl"))
    per_gpu = tokens_per_s_per_gpu(summary, devices)
    row.update(measurements(summary, per_gpu, strategy, settings))
    if summary["peak_allocated_gib"] is not None:  # a GPU's peak, beside what the planner predicted for it
        row["planned_peak_gib"] = planned_peak_gib(strategy, settings, devices)
    row.update(monitor.training_utilisation(summary["wall_s"]))
    row["gpu_util_source"] = sampler.kind if sampler is not None and sampler.kind else None
    if settings["layers"] != settings["full_layers"]:
        row["scaled_estimate"] = scaled_estimate(row["wall_s"], per_gpu, strategy, settings)
    log(progress_line(strategy, row, per_gpu))
    return row
