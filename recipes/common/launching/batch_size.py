"""`--batch-size auto` and `--global-batch-size N`: the micro-batch and accumulation of a run.

The global batch (sequences per optimizer step) is micro-batch x accumulation x data-parallel
processes. With `--global-batch-size N` the recipe keeps N and works out the accumulation; with
`--batch-size auto` the micro-batch is the largest the memory plan says fits (recipes/planner, the
same arithmetic as `scripts/plan.py`), within the global batch when one is given.

Settled once, before the model loads, the same on every rank (each reads only the launch and the
flags), so the run's `batch_size` and `grad_accum` are plain numbers from then on (settled.py).
"""

from __future__ import annotations

import os

import torch

import planner

from ..model import loss_head
from ..refusal import refuse
from .args import AUTO
from .launch import DEEPSPEED
from .memory_plan import card_flags, planner_inputs, vision_flags
from .settled import Run


def memory_gib(launch) -> tuple[float, str]:
    """The memory one rank may plan with: its GPU's, or on CPU the machine's RAM shared by the
    processes on it."""
    if launch.on_gpu:
        properties = torch.cuda.get_device_properties(0)
        return properties.total_memory / 2**30, properties.name
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return ram / local, f"CPU RAM / {local} process(es)"


# Micro-batches per step planned for a pipeline whose --grad-accum is not settled yet: enough for every stage
# to hold as many as its schedule ever does (the plan's worst case).
PIPELINE_FULL = 1024


def planned_micro_batch(args, recipe: str, launch) -> dict:
    """The planner's largest micro-batch for this run, with what it was planned for."""
    try:
        shape, inputs = planner_inputs(args, recipe, launch)
    except Exception as error:  # offline hub id, unknown architecture
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        refuse(f"--batch-size auto plans from the model's config.json, which cannot be read here ({reason}); "
               "give --batch-size N")
    gib, device = memory_gib(launch)
    # eager's activations even under --compile: the step that confirms the micro-batch on the GPU runs before the
    # layers are compiled (confirm_on_gpu), and keeps what eager keeps
    inputs["compiled"] = False
    if launch.pipeline_stages > 1:  # the launch's layout, with as many micro-batches in flight as its schedule holds
        inputs.update(pipeline_stages=launch.pipeline_stages, pipeline_chunks=launch.pipeline_chunks,
                      grad_accum=PIPELINE_FULL)
    try:
        fit = planner.max_micro_batch(shape, recipe, launch.planner_strategy, launch.gpus, gib, **inputs)
    except ValueError as error:  # e.g. LoRA targets the planner does not know
        refuse(f"--batch-size auto cannot plan this run ({str(error).splitlines()[0]}); give --batch-size N")
    if fit == 0:
        refuse(f"the plan says not even one sequence of --max-length {args.max_length} fits in {gib:.0f} GiB "
               f"({device}) with {launch.planner_strategy}; see `python scripts/plan.py --model {args.model} "
               f"--method {recipe} --gpus {launch.gpus} {card_flags(device, gib)} --seq-len {args.max_length}"
               f"{vision_flags(inputs)}`")
    return {"fits": fit, "memory_gib": round(gib, 3), "device": device, "strategy": launch.planner_strategy}


def rows_per_step(run, launch) -> int:
    """The global batch: sequences (preference pairs) an optimizer step takes over all ranks."""
    return run.batch_size * run.grad_accum * launch.data_parallel_size


def largest_divisor_up_to(number: int, limit: int) -> int:
    return max(d for d in range(1, min(number, limit) + 1) if number % d == 0)


def settle(run: Run, recipe: str, launch) -> tuple[Run, str | None]:
    """The run with its micro-batch and accumulation settled, and the line that says how (None when
    neither `auto` nor a global batch was asked: the run as it was)."""
    run = Run.of(run)
    auto, target = run.batch_size == AUTO, run.global_batch_size
    if not auto and not target:
        return run, None
    ranks = launch.data_parallel_size
    uneven = target and planner.uneven_global_batch(target, ranks)  # the rule scripts/plan.py plans with
    if uneven:
        refuse(uneven)
    per_rank = target // ranks if target else None
    plan = None
    if auto:
        plan = planned_micro_batch(run, recipe, launch)
        micro = largest_divisor_up_to(per_rank, plan["fits"]) if per_rank else plan["fits"]
    else:
        micro = run.batch_size
        if per_rank % micro:
            refuse(f"--global-batch-size {target} is {per_rank} sequences per process, which --batch-size {micro} "
                   f"does not divide; use --batch-size {largest_divisor_up_to(per_rank, micro)} (or auto)")
    accum = per_rank // micro if per_rank else run.grad_accum
    if per_rank and "grad_accum" in run.given_flags and accum != run.grad_accum:
        refuse(f"--global-batch-size {target} with a micro-batch of {micro} on {ranks} process(es) needs "
               f"--grad-accum {accum}, but --grad-accum {run.grad_accum} was given; drop one of them")
    changes = {}
    if auto:
        changes["batch_size"] = (micro, f"--batch-size auto (the memory plan{f', within --global-batch-size {target}' if target else ''})")
    if accum != run.grad_accum:
        changes["grad_accum"] = (accum, f"--global-batch-size {target} / (micro-batch {micro} x {ranks} process(es))")
    run = run.settled(changes).recorded(batch_plan={"asked": {"batch_size": AUTO if auto else micro,
                                                              "global_batch_size": target},
                                                    **({"planner": plan} if plan else {})})
    why = (f" (the plan fits {plan['fits']} in {plan['memory_gib']:.3g} GiB, {plan['device']})" if plan else "")
    # under sequence parallel the processes of a group share their micro-batches, each a slice of every row
    each, ranks_of = ((f"group of {launch.sequence_parallel} processes", "group(s)") if launch.sequence_parallel > 1
                      else ("process", "process(es)"))
    return run, (f"batch: {micro} per {each}{why} x --grad-accum {accum} x {ranks} {ranks_of} = "
                 f"{micro * accum * ranks} sequences per step")


def back_off(fits_step, start: int, per_rank: int | None) -> int:
    """The largest micro-batch from `start` down for which `fits_step(size)` is true, halving on a
    failure (and keeping to divisors of the per-process share of a global batch); 0 if none."""
    size = start
    while size >= 1:
        if fits_step(size):
            return size
        size = largest_divisor_up_to(per_rank, size // 2) if per_rank and size > 1 else size // 2
    return 0


def confirm_on_gpu(accelerator, launch, model, run: Run, token_losses) -> Run:
    """--batch-size auto on GPUs: run one real forward and backward of the planned micro-batch at
    --max-length tokens, its loss the recipe's `token_losses` computed as the loop computes it
    (model.loss_head), and take a smaller one (halving) if it runs out of memory. Before the
    loaders are built, so the batch and accumulation can still change. Only where each GPU holds
    the whole model (unsharded strategies): a sharded model is only sharded by `prepare`, and a pipeline
    stage runs only within its schedule; there, and under DeepSpeed (whose engine config already holds
    the batch), the plan alone decides. Every rank takes the smallest
    size any rank could run. Returns the run with the size that ran (the same run when nothing changed).

    Not yet run on a GPU."""
    plan = run.batch_plan
    if (not launch.on_gpu or plan.get("asked", {}).get("batch_size") != AUTO or launch.shards_parameters
            or launch.pipeline_stages > 1 or launch.kind == DEEPSPEED):
        return run

    if launch.kind != "model_parallel":
        model.to(accelerator.device)
    device = next(model.parameters()).device
    optimizer_bytes = 8 * sum(p.numel() for p in model.parameters() if p.requires_grad)  # AdamW, after step 1
    usable = torch.cuda.get_device_properties(device).total_memory * 0.92  # planner.HEADROOM's margin

    head = loss_head.settle(accelerator, model)  # the loss as the loop computes it (chunked where it chunks)

    def fits_step(size: int) -> bool:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        tokens = torch.randint(0, model.config.vocab_size, (size, run.max_length), device=device)
        positions = torch.arange(run.max_length - 1)  # every position a target: the bound a plan holds
        try:
            with accelerator.autocast():
                outputs = model(input_ids=tokens, use_cache=False, **head.forward_arguments(positions))
                loss = head.apply(token_losses, outputs, tokens[:, 1:], positions.to(device)).sum()
            del outputs
            loss.backward()
            peak = torch.cuda.max_memory_allocated(device)
        except torch.cuda.OutOfMemoryError:
            peak = None
        model.zero_grad(set_to_none=True)
        loss = None
        torch.cuda.empty_cache()
        return peak is not None and peak + optimizer_bytes <= usable

    per_rank = (plan["asked"]["global_batch_size"] or 0) // launch.data_parallel_size or None
    found = back_off(fits_step, run.batch_size, per_rank)
    # a collective: the smallest over ranks (accelerate reduces by sum or max only)
    agreed = -int(accelerator.reduce(torch.tensor(-found, device=accelerator.device), "max"))
    if agreed == 0:
        refuse(f"not one sequence of --max-length {run.max_length} fits a real step on this GPU; lower "
               "--max-length, add --gradient-checkpointing, or use a sharded config (fsdp.yaml, zero3.yaml)")
    if agreed == run.batch_size:
        return run
    source = "a real step on the GPU (the planned micro-batch ran out of memory)"
    accum = per_rank // agreed if per_rank else run.grad_accum
    changes = {"batch_size": (agreed, source), **({"grad_accum": (accum, source)} if accum != run.grad_accum else {})}
    run = run.settled(changes).recorded(
        batch_plan={**plan, "confirmed": {"planned": run.batch_size, "ran": agreed}})
    accelerator.gradient_accumulation_steps = accum  # accelerate's division of each micro-batch's loss
    if accelerator.is_main_process:
        print(f"batch: the planned micro-batch ran out of memory in a real step; {agreed} per process x "
              f"--grad-accum {accum}", flush=True)
    return run
