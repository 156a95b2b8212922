"""The memory plan of this very run: the planner's inputs read from the run (the same arithmetic as
`scripts/plan.py`), and the `plan:` line every launch prints before loading.
"""

from __future__ import annotations

import os

import torch

import planner

from ..model.model_config import is_default_model


def planner_inputs(args, recipe: str, launch) -> tuple:
    """The model's shape and the planner's keyword arguments for this run (all but the micro-batch).
    Raises when the shape cannot be read (an offline hub id, an unknown architecture)."""
    source = "tiny-llama" if is_default_model(args.model) else args.model  # before its first build
    shape = planner.load_shape(source)
    inputs = dict(seq_len=args.max_length, gradient_checkpointing=args.gradient_checkpointing,
                  precision="bf16" if launch.precision in ("bf16", "fp16") else "fp32")
    if recipe != "full":
        inputs.update(lora_rank=args.lora_r, lora_targets=args.lora_targets, lora_dropout=args.lora_dropout)
    return shape, inputs


def announce_plan(args, recipe: str, launch) -> None:
    """Print the memory plan of this very run, and warn before loading when it will not fit."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    try:
        shape, inputs = planner_inputs(args, recipe, launch)
    except Exception as error:  # offline hub id, unknown architecture: a courtesy, never a blocker
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"plan: skipped ({reason})", flush=True)
        return
    strategy, gpus = launch.planner_strategy, launch.gpus
    layout = dict(pipeline_stages=launch.pipeline_stages, pipeline_chunks=launch.pipeline_chunks) \
        if launch.pipeline_stages > 1 else {}
    try:
        need = planner.per_gpu_bytes(shape, recipe, strategy, gpus, batch_size=args.batch_size, **inputs,
                                     grad_accum=args.grad_accum, **layout)
    except ValueError as error:  # e.g. LoRA targets the planner does not know
        print(f"plan: skipped ({str(error).splitlines()[0]})", flush=True)
        return
    parts = ", ".join(f"{key} {size(need[key])}" for key in ("weights", "gradients", "optimizer", "activations"))
    line = (f"plan: {recipe} with {strategy} on {gpus} process(es): {size(need['total'])} per GPU ({parts}) "
            f"at --max-length {args.max_length}")
    if not launch.on_gpu:
        print(line, flush=True)
        return
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / planner.GiB
    print(f"{line}; the GPU has {gpu_gib:.0f} GiB", flush=True)
    if not planner.fits(need["total"], gpu_gib):
        print(f"warning: the plan says this will not fit; see `python scripts/plan.py --model {args.model} "
              f"--method {recipe} --gpus {gpus} --gpu-memory {gpu_gib:.0f} --batch-size {args.batch_size} "
              f"--seq-len {args.max_length}` for a config and micro-batch that fit", flush=True)


def size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"
