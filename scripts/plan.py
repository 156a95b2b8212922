#!/usr/bin/env python
"""Will it fit, and which config? GPU memory per strategy for a model, a method and a workload.

Prints one row per config in accelerate_configs/ (weights, gradients, optimizer state and
activations on the busiest GPU, in GiB), then the config that needs the fewest GPUs and the
fastest config that fits. Nothing is downloaded and no GPU is needed: the arithmetic
(recipes/planner/) works from the model's config.json.

Examples:
    python scripts/plan.py --model tinyllama-1.1b --method lora --gpus 4 --gpu-memory 48 --batch-size 16
    python scripts/plan.py --model codellama-34b --method qlora --gpus 1 --gpu-memory 48 \\
        --batch-size 4 --seq-len 1024 --gradient-checkpointing
    python scripts/plan.py --model path/to/model_folder --method full --json

--model takes an offline alias (a config shipped in data/model_configs/: llama-3.1-8b, qwen2.5-72b, mixtral-8x7b, ...), a config .json, a
local model folder, or a hub id (read with transformers.AutoConfig: needs the network or the cache).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "recipes"))

import planner  # noqa: E402  (recipes/planner/: pure Python, no torch)


def parse_args(argv=None) -> argparse.Namespace:
    summary, _, details = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default="tinyllama-1.1b",
        help="alias, config .json, model folder or hub id (default: tinyllama-1.1b)")
    add("--method", choices=planner.METHODS, default="lora", help="the recipe: full, lora or qlora (default: lora)")
    add("--gpus", type=int, default=4, help="GPUs available (default: 4, as the configs are set)")
    add("--gpu-memory", type=float, default=80.0, help="memory of one GPU in GB, as sold (default: 80)")
    add("--batch-size", type=int, default=8, help="micro-batch per GPU, the recipes' --batch-size (default: 8)")
    add("--seq-len", type=int, default=512, help="tokens per sequence, the recipes' --max-length (default: 512)")
    add("--gradient-checkpointing", nargs="?", type=int, const=1, default=0, metavar="EVERY_N",
        help="the recipes' --gradient-checkpointing (bare: every layer, N: every Nth layer)")
    add("--lora-r", type=int, default=16, help="adapter rank (default: 16, as the recipes)")
    add("--lora-targets", default="all-linear", help="comma-separated module names, or all-linear (default)")
    add("--lora-dropout", type=float, default=0.05, help="adapter dropout; its masks cost memory (default: 0.05)")
    add("--precision", choices=("bf16", "fp32"), default="bf16",
        help="bf16 (the configs' mixed precision) or fp32 (--mixed_precision no)")
    add("--attention", choices=planner.ATTENTIONS, default="sdpa", help="attention implementation (default: sdpa)")
    add("--json", action="store_true", help="print the plan as JSON instead of the table")
    args = parser.parse_args(argv)
    for name in ("gpus", "batch_size", "seq_len", "lora_r"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.gpu_memory <= 0:
        parser.error("--gpu-memory must be > 0")
    if args.gpu_memory.is_integer():
        args.gpu_memory = int(args.gpu_memory)
    try:
        planner.lora_target_names(args.lora_targets)
    except ValueError as error:
        parser.error(str(error))
    return args


def gib(value: float) -> str:
    return f"{value / planner.GiB:.2f}"


def count(value: int) -> str:
    return f"{value / 1e9:.2f} B" if value >= 1e9 else f"{value / 1e6:.2f} M"


def describe(shape, args) -> list[str]:
    method = args.method
    if method != "full":
        trainable = planner.lora_parameters(shape, args.lora_r, args.lora_targets)
        method += f", r={args.lora_r}, {args.lora_targets} ({count(trainable)} trainable)"
    every = args.gradient_checkpointing
    checkpointing = ("no gradient checkpointing" if not every else "gradient checkpointing"
                     + (f" of one layer in {every}" if every > 1 else ""))
    return [
        f"model: {shape.name} ({count(shape.parameters)} parameters); method: {method}",
        f"workload: micro-batch {args.batch_size} x {args.seq_len} tokens per GPU, {args.precision}, "
        f"{args.attention} attention, {checkpointing}",
        f"GPUs: {args.gpus} x {args.gpu_memory:g} GiB; a plan may use {gib(planner.usable_bytes(args.gpu_memory))} GiB "
        f"of each (10% stays free for the CUDA context and fragmentation)",
    ]


def table(plan: dict, batches: dict) -> list[str]:
    header = ["strategy", "config", "weights", "grads", "optimizer", "activations", "total", "fits", "max micro-batch"]
    rows = []
    for entry in plan["strategies"]:
        usage = entry["per_gpu_bytes"]
        rows.append([entry["strategy"], entry["config"], gib(usage["weights"]), gib(usage["gradients"]),
                     gib(usage["optimizer"]), gib(usage["activations"]), gib(usage["total"]),
                     "yes" if entry["fits"] else "no", str(batches[entry["strategy"]] or "-")])
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
    left = {0, 1, 7}

    def line(cells):
        padded = (cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    return ["GiB per GPU (the busiest one):", line(header)] + [line(row) for row in rows]


def launch_command(config: str, strategy: str, args, batch_size: int, grad_accum: int = 1) -> str:
    processes = "" if strategy == "model_parallel" else f" --num_processes {args.gpus}"
    if strategy in planner.TENSOR_PARALLEL:  # the mesh for this many GPUs (the files are written for 4)
        tp = planner.tensor_parallel_size(strategy, args.gpus)
        processes += f" --parallelism_config_tp_size {tp}"
        processes += f" --parallelism_config_dp_shard_size {args.gpus // tp}" if strategy == "fsdp_tp" else ""
    command = (f"accelerate launch --config_file {config}{processes} recipes/{args.method}.py "
               f"--batch-size {batch_size} --max-length {args.seq_len}")
    if grad_accum > 1:
        command += f" --grad-accum {grad_accum}"
    if args.gradient_checkpointing:
        every = args.gradient_checkpointing
        command += " --gradient-checkpointing" + (f" {every}" if every > 1 else "")
    return command


def sentences(shape, plan: dict, batches: dict, args) -> list[str]:
    rec = plan["recommendation"]
    fastest, fewest = rec["fastest"], rec["fewest_gpus"]
    lines = []
    if fastest is None:
        lines.append(rec["reason"][:1].upper() + rec["reason"][1:] + ".")
    else:
        lines.append(f"Fastest that fits on {args.gpus} GPUs: {fastest['strategy']} ({fastest['config']}), "
                     f"micro-batch up to {fastest['max_micro_batch']}.")
    if fewest is not None:
        gpus = "1 GPU" if fewest["gpus"] == 1 else f"{fewest['gpus']} GPUs"
        lines.append(f"Fewest GPUs: {gpus} with {fewest['strategy']} ({fewest['config']}), "
                     f"micro-batch up to {fewest['max_micro_batch']}.")
    # A faster strategy that fits a smaller micro-batch beats a slower one at the asked size:
    # gradient accumulation keeps the global batch.
    faster = None
    best = planner.SPEED_ORDER.index(fastest["strategy"]) if fastest else len(planner.SPEED_ORDER)
    for strategy in planner.SPEED_ORDER[:best]:
        if batches.get(strategy):  # (absent: a strategy the recipes do not run for this method)
            micro = max(b for b in range(1, batches[strategy] + 1) if args.batch_size % b == 0)
            faster = (strategy, micro, args.batch_size // micro)
            lines.append(f"Faster with gradient accumulation: {strategy} ({planner.STRATEGIES[strategy]}) fits a "
                         f"micro-batch up to {batches[strategy]}; --batch-size {micro} --grad-accum "
                         f"{args.batch_size // micro} keeps the global batch.")
            break
    used = {r["strategy"] for r in (fastest, fewest) if r} | ({faster[0]} if faster else set())
    for strategy in sorted(used & {"fsdp_offload", "zero3_offload"}):
        ram = planner.cpu_offload_bytes(shape, args.method, strategy, args.gpus, args.lora_r, args.lora_targets,
                                        args.precision)
        lines.append(f"{strategy} keeps about {gib(ram)} GiB of training state in CPU RAM.")
    if fastest is not None:
        batch = min(args.batch_size, fastest["max_micro_batch"])
        lines.append(f"Launch: {launch_command(fastest['config'], fastest['strategy'], args, batch)}")
    if faster is not None:
        strategy, micro, accum = faster
        lines.append(f"    or: {launch_command(planner.STRATEGIES[strategy], strategy, args, micro, accum)}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        shape = planner.load_shape(args.model)
    except ValueError as error:
        print(f"plan.py: {error}", file=sys.stderr)
        return 2
    settings = dict(seq_len=args.seq_len, gradient_checkpointing=args.gradient_checkpointing, lora_rank=args.lora_r,
                    lora_targets=args.lora_targets, precision=args.precision, attention=args.attention,
                    lora_dropout=args.lora_dropout)
    plan = planner.plan(shape, args.method, args.gpus, args.gpu_memory, batch_size=args.batch_size, **settings)
    if args.json:
        print(json.dumps(plan, indent=2))
        return 0
    batches = {s: planner.max_micro_batch(shape, args.method, s, args.gpus, args.gpu_memory, **settings)
               for s in planner.possible_strategies(args.method, args.gpus, shape, args.lora_targets)}
    print("\n".join(describe(shape, args) + [""] + table(plan, batches) + [""] + sentences(shape, plan, batches, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
