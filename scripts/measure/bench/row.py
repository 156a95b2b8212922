"""One strategy's row of results.json: what was launched, why it failed, or the numbers of its metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from bench.flops import flop_per_token, mfu
from bench.formatting import format_duration, percent
from bench.shapes import shape_of
from bench.workloads import Strategy
from planner import STRATEGIES as PLANNED_CONFIGS
from planner import per_gpu_bytes


def launch_row(strategy: Strategy, settings: dict, processes: int, devices: int, command_line: str,
               output: Path) -> dict:
    """What the launch is: workload, strategy, processes, devices, batch, the command and its folder."""
    return {
        "workload": settings["workload"].name, "workload_label": settings["workload"].label,
        "strategy": strategy.name, "strategy_label": strategy.label, "config": f"accelerate_configs/{strategy.config}.yaml",
        "recipe": f"recipes/{strategy.recipe}.py", "processes": processes, "gpus": devices,
        "device": settings["device_label"], "layers": settings["layers"], "full_layers": settings["full_layers"],
        "batch_size": settings["batch_size"], "grad_accum": settings["grad_accum"],
        "max_length": settings["workload"].max_length, "gradient_checkpointing": settings["gradient_checkpointing"],
        "command": command_line, "output_dir": str(output),
    }


def failure_message(log_path: Path, returncode) -> str:
    """The exit status and the last line of the launch's log that names an error (or memory), else its last line."""
    tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
    reason = next((line for line in reversed(tail) if "error" in line.lower() or "memory" in line.lower()),
                  tail[-1] if tail else "no output")
    return f"exit {returncode}: {reason.strip()[:300]}"


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def method_of(strategy: Strategy) -> str:
    return "qlora" if strategy.recipe == "qlora" else "lora"


def tokens_per_s_per_gpu(summary: dict, devices: int) -> float:
    return summary["tokens"] / summary["wall_s"] / devices


def measurements(summary: dict, per_gpu: float, strategy: Strategy, settings: dict) -> dict:
    """Steps, tokens, wall time, tokens/s per GPU, FLOP per token, MFU and utilisation, peak memory, loss."""
    shape = settings["shape"]
    method = method_of(strategy)
    flop = flop_per_token(shape, settings["workload"].max_length, method)
    flop_done = flop_per_token(shape, settings["workload"].max_length, method,
                               recompute=settings["gradient_checkpointing"])
    peak = settings["peak_tflops"] * 1e12
    return {
        "status": "ok", "steps": summary["steps"], "tokens": summary["tokens"], "wall_s": round(summary["wall_s"], 3),
        "wall_rule": summary["rule"], "median_step_s": round(summary["median_step_s"], 4),
        "first_step_s": round(summary["first_step_s"], 3), "tokens_per_s_per_gpu": round(per_gpu, 1),
        "flop_per_token": flop, "flop_per_token_with_recompute": flop_done,
        "peak_tflops_per_gpu": settings["peak_tflops"],
        "mfu": mfu(per_gpu, flop, peak), "utilisation": mfu(per_gpu, flop_done, peak),
        "peak_allocated_gib": summary["peak_allocated_gib"], "peak_reserved_gib": summary["peak_reserved_gib"],
        "final_loss": summary["final_loss"],
    }


def planned_peak_gib(strategy: Strategy, settings: dict, devices: int) -> float | None:
    """The planner's per-GPU peak for this launch (bf16, the recipes' LoRA defaults, rows of exactly --max-length
    as random_data writes them: no padding mask; compiled blocks under --compile), to set beside the measured one; None for a config the
    planner does not plan."""
    planned_names = [name for name, path in PLANNED_CONFIGS.items() if path == f"accelerate_configs/{strategy.config}.yaml"]
    if not planned_names:
        return None
    planned = per_gpu_bytes(settings["shape"], method_of(strategy), planned_names[0], devices,
                            batch_size=settings["batch_size"], seq_len=settings["workload"].max_length,
                            gradient_checkpointing=int(settings["gradient_checkpointing"]), precision="bf16",
                            compiled="--compile" in settings["recipe_args"], padded=False)  # rows of --max-length
    return round(planned["total"] / 2**30, 3)


def scaled_estimate(wall_s: float, per_gpu: float, strategy: Strategy, settings: dict) -> dict:
    """A run with fewer layers than the model has, scaled per layer to the full depth by the FLOP per token
    of the whole model: assumes the measured MFU holds. An estimate, labelled as such."""
    method = method_of(strategy)
    flop = flop_per_token(settings["shape"], settings["workload"].max_length, method)
    full = shape_of(settings["workload"].config, settings["full_layers"])
    ratio = flop_per_token(full, settings["workload"].max_length, method) / flop
    return {
        "layers": settings["full_layers"], "factor": ratio, "wall_s": round(wall_s * ratio, 1),
        "tokens_per_s_per_gpu": round(per_gpu / ratio, 1),
        "method": (f"estimate, not measured: the {settings['layers']}-layer wall time x FLOP/token of "
                   f"{settings['full_layers']} layers / FLOP/token of {settings['layers']} layers "
                   f"(x{ratio:.2f}); assumes the measured MFU holds for the full depth"),
    }


def progress_line(strategy: Strategy, row: dict, per_gpu: float) -> str:
    return (f"[{strategy.name}] wall {format_duration(row['wall_s'])} ({row['steps']} steps), "
            f"{per_gpu:,.0f} tokens/s/GPU, MFU {percent(row['mfu'])}, GPU util {percent(row['gpu_util'])}, "
            f"launch {format_duration(row['end_to_end_s'])}")
