"""Time from metrics.jsonl: the training loop's wall time (the rule), steady-state speed, a run's summary."""

from __future__ import annotations

import statistics

WALL_RULE = ("training loop only, model loading and compile warm-up apart: last step's elapsed_s - first "
             "step's elapsed_s + median step (the first step, which includes warm-up/compile, is replaced "
             "by the median step)")


def training_wall_time(elapsed: list[float]) -> dict:
    """The training loop's wall time from the steps' `elapsed_s` (in step order).

    wall = elapsed[-1] - elapsed[0] + median step, where the step durations are elapsed[i] - elapsed[i-1]
    for the steps after the first: the first step (clock start -> first step end: warm-up, compile,
    allocator growth) is replaced by the median of the others. With a single step nothing can replace
    it: wall = its elapsed_s (rule "single step, warm-up included").
    """
    if not elapsed:
        raise ValueError("no training steps in metrics.jsonl")
    if len(elapsed) == 1:
        return {"wall_s": float(elapsed[0]), "median_step_s": float(elapsed[0]), "first_step_s": float(elapsed[0]),
                "steps": 1, "rule": "single step, warm-up included"}
    durations = [later - earlier for earlier, later in zip(elapsed, elapsed[1:])]
    median = statistics.median(durations)
    return {"wall_s": float(elapsed[-1] - elapsed[0] + median), "median_step_s": float(median),
            "first_step_s": float(elapsed[0]), "steps": len(elapsed), "rule": "first step replaced by the median"}


def steady_state(lines: list[dict], warmup_steps: int) -> dict:
    """Step time and tokens/s from metrics.jsonl's train lines, the first `warmup_steps` steps left out.

    The steady part runs from the end of step `warmup_steps` (0: from the end of step 1's predecessor,
    i.e. the clock's first reading is step 1's end) to the end of the last step; its tokens are those
    of the steps that end inside it. `epoch_s` is the mean steady step times every step of the run.
    """
    train = sorted((line for line in lines if line.get("type") == "train"), key=lambda line: line["step"])
    if len(train) < warmup_steps + 2:
        raise ValueError(f"{len(train)} steps: too few to leave {warmup_steps} warm-up steps out")
    steady_steps = len(train) - warmup_steps - 1
    seconds = train[-1]["elapsed_s"] - train[warmup_steps]["elapsed_s"]
    tokens = sum(line["tokens"] for line in train[warmup_steps + 1:])
    peaks = [line["peak_allocated_gib"] for line in train if line.get("peak_allocated_gib") is not None]
    return {"steps": len(train), "steady_s": seconds, "steady_tokens": tokens, "step_s": seconds / steady_steps,
            "epoch_s": seconds / steady_steps * len(train),
            "tokens_per_s": tokens / seconds if seconds > 0 else float("inf"),
            "epoch_tokens": sum(line["tokens"] for line in train),
            "peak_allocated_gib": max(peaks) if peaks else None, "final_loss": train[-1].get("loss")}


def summarise_metrics(lines: list[dict]) -> dict:
    """Steps, tokens, wall time and peak memory from metrics.jsonl's records."""
    train = sorted((line for line in lines if line.get("type") == "train"), key=lambda line: line["step"])
    if not train:
        raise ValueError("metrics.jsonl has no training step")
    summary = training_wall_time([line["elapsed_s"] for line in train])
    summary["tokens"] = int(sum(line["tokens"] for line in train))
    for key in ("peak_allocated_gib", "peak_reserved_gib"):
        values = [line[key] for line in train if line.get(key) is not None]
        summary[key] = max(values) if values else None
    summary["final_loss"] = train[-1]["loss"]
    return summary
