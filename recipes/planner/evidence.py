"""What the plan of each strategy rests on: the strategies this project has run on a GPU, and where
those runs are written up. A strategy not listed has run on CPU processes only, so its memory and time
are the planner's arithmetic, which no GPU has checked; `scripts/plan.py` says which on each
recommendation.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuRun:
    gpus: int  # the most GPUs one launch of it has used
    results: str  # the results folder whose README reports it


# Each ran as one process on one GPU (an H100, then an H200): the recipes' memory on that GPU, training
# and the reload checked; no launch over several GPUs has run yet.
RAN_ON_GPU = {
    "ddp": GpuRun(1, "results/2026-11-26_h100_call1"),
    "fsdp_full_shard": GpuRun(1, "results/2026-11-26_h100_call1"),
    "zero3": GpuRun(1, "results/2026-11-26_h100_call1"),
}


def gpu_evidence(strategy: str, gpus: int) -> str:
    """One sentence: whether `strategy` on `gpus` GPUs has run on a GPU in this project, or is an estimate only."""
    ran = RAN_ON_GPU.get(strategy)
    if ran is None:
        return f"Estimate only: {strategy} has not run on a GPU in this project."
    if gpus > ran.gpus:
        return (f"Estimate only on {gpus} GPUs: {strategy} has run on {ran.gpus} GPU{'s' if ran.gpus > 1 else ''} in "
                f"this project ({ran.results}), never on {gpus}.")
    return f"Tested on a GPU: {strategy} has run on {gpus} GPU{'s' if gpus > 1 else ''} in this project ({ran.results})."
