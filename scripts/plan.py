#!/usr/bin/env python
"""Will it fit, and which config? GPU memory per strategy for a model, a method and a workload.

Prints one row per config in accelerate_configs/ (weights, gradients, optimizer state and
activations on the busiest GPU, in GiB), then each config's estimated time per step and per epoch
(FLOPs at an assumed share of the GPU's peak plus the bytes the strategy moves over the link),
then the launch command of the fastest config that fits and the config that needs the fewest
GPUs, and the host RAM each needs per machine while the weights load. Nothing is downloaded and no GPU is needed: the arithmetic (recipes/planner/) works from
the model's config.json.

Examples:
    python scripts/plan.py --model tinyllama-1.1b --method lora --gpus 4 --gpu rtx6000-ada \\
        --batch-size 16 --grad-accum 2 --seq-len 1024
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
    add("--gpu", default=planner.DEFAULT_GPU, metavar="NAME",
        help=f"the GPU model: {', '.join(planner.GPUS)} (default: {planner.DEFAULT_GPU}); sets the memory, "
             "the peak and the usual link")
    add("--gpu-memory", type=float, default=None, help="memory of one GPU in GB, as sold (default: the --gpu's)")
    add("--interconnect", choices=planner.INTERCONNECTS, default=None,
        help="the link between the GPUs (default: the --gpu's usual one; network: between machines)")
    add("--bandwidth", type=float, default=None, metavar="GB_S",
        help="collectives' bus bandwidth in GB/s, as nccl-tests prints busbw (default: assumed from the link)")
    add("--gpus-per-machine", type=int, default=planner.GPUS_PER_MACHINE,
        help=f"GPUs in one machine: collectives over more cross the network (default: {planner.GPUS_PER_MACHINE})")
    add("--network-bandwidth", type=float, default=planner.NETWORK, metavar="GB_S",
        help=f"bus bandwidth between machines in GB/s (default: {planner.NETWORK:g}, 100 Gb/s at ~80%%)")
    add("--mfu", type=float, default=planner.DEFAULT_MFU,
        help=f"share of the GPU's dense peak the matmuls sustain (default: {planner.DEFAULT_MFU})")
    add("--batch-size", type=int, default=8, help="micro-batch per GPU, the recipes' --batch-size (default: 8)")
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step, the recipes' --grad-accum "
                                                  "(default: 1)")
    add("--rows", type=int, default=1024, help="sequences in an epoch, for the time per epoch (default: 1024)")
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
    for name in ("gpus", "batch_size", "seq_len", "lora_r", "grad_accum", "rows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        planner.lora_target_names(args.lora_targets)
        args.machine = planner.Machine.of(args.gpu, args.interconnect, args.bandwidth, args.mfu,
                                          args.gpus_per_machine, args.network_bandwidth)
    except ValueError as error:
        parser.error(str(error))
    if args.gpu_memory is None:
        args.gpu_memory = args.machine.gpu.memory_gb
    if args.gpu_memory <= 0:
        parser.error("--gpu-memory must be > 0")
    if float(args.gpu_memory).is_integer():
        args.gpu_memory = int(args.gpu_memory)
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
    accum = f", {args.grad_accum} micro-batches per step" if args.grad_accum > 1 else ""
    return [
        f"model: {shape.name} ({count(shape.parameters)} parameters); method: {method}",
        f"workload: micro-batch {args.batch_size} x {args.seq_len} tokens per GPU{accum}, {args.precision}, "
        f"{args.attention} attention, {checkpointing}",
        f"GPUs: {args.gpus} x {args.machine.gpu.name} with {args.gpu_memory:g} GiB; a plan may use "
        f"{gib(planner.usable_bytes(args.gpu_memory))} GiB of each (10% stays free for the CUDA context and "
        "fragmentation)",
    ]


def aligned(header: list[str], rows: list[list[str]], left: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]

    def line(cells):
        padded = (cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    return [line(header)] + [line(row) for row in rows]


def table(plan: dict, batches: dict) -> list[str]:
    header = ["strategy", "config", "weights", "grads", "optimizer", "activations", "total", "fits", "max micro-batch"]
    rows = []
    for entry in plan["strategies"]:
        usage = entry["per_gpu_bytes"]
        rows.append([entry["strategy"], entry["config"], gib(usage["weights"]), gib(usage["gradients"]),
                     gib(usage["optimizer"]), gib(usage["activations"]), gib(usage["total"]),
                     "yes" if entry["fits"] else "no", str(batches[entry["strategy"]] or "-")])
    return ["GiB per GPU (the busiest one):"] + aligned(header, rows, {0, 1, 7})


def plural(gpus: int) -> str:
    return "1 GPU" if gpus == 1 else f"{gpus} GPUs"


def seconds(value: float) -> str:
    if value >= 3600:
        return f"{value / 3600:.1f} h"
    if value >= 120:
        return f"{value / 60:.1f} min"
    if value == 0:
        return "0"
    if value < 0.1:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"


def pipeline_layout(run: dict, gpus: int) -> str:
    """How a pipeline run splits the GPUs ('' for the other strategies)."""
    if "pipeline_stages" not in run:
        return ""
    stages, chunks = run["pipeline_stages"], run["pipeline_chunks"]
    text = f"{stages} stages" + (f" x {gpus // stages} replicas" if stages < gpus else "")
    return text + (", interleaved" if chunks > 1 else "")


def runs_as(run: dict, gpus: int = 0) -> str:
    text = f"{run['micro_batch']} x {run['grad_accum']}"
    if pipeline_layout(run, gpus):
        text += f" ({pipeline_layout(run, gpus)})"
    if run["gradient_checkpointing"]:
        every = run["gradient_checkpointing"]
        text += ", checkpointing" + (f" 1 in {every}" if every > 1 else "")
    return text


def time_table(plan: dict, args) -> list[str]:
    machine = plan["machine"]
    header = ["strategy", "micro-batch x accum", "global batch", "compute", "communication", "other", "per step",
              "per epoch", "note"]
    running = sorted((e for e in plan["strategies"] if e["run"]), key=lambda e: planner.rank_key(e["run"]))
    rows = []
    for entry in running:
        run, time = entry["run"], entry["run"]["time"]
        note = []
        if time["idle_share"]:
            note.append(f"{1 - time['idle_share']:.0%} of GPU time busy")
        if run["tight"]:
            note.append(f"tight: {run['total_bytes'] / planner.usable_bytes(args.gpu_memory):.0%} of usable memory")
        rows.append([entry["strategy"], runs_as(run, args.gpus), str(run["global_batch"]), seconds(time["compute"]),
                     seconds(time["communication"]), seconds(time["other"]), seconds(time["step"]),
                     seconds(run["seconds_per_epoch"]), "; ".join(note)])
    rows += [[e["strategy"], "does not fit", "", "", "", "", "", "", ""] for e in plan["strategies"] if not e["run"]]
    intro = (f"Time per optimizer step and per epoch of {machine['rows']:,} rows, fastest first (an estimate: "
             f"{machine['mfu']:.0%} of {machine['gpu']}'s {machine['peak_tflops']:g} TFLOP/s {args.precision} peak; "
             f"collectives at {machine['bandwidth_gb_s']:g} GB/s over {machine['link']}"
             + (f", at {machine['network_gb_s']:g} GB/s over the network beyond {machine['gpus_per_machine']} GPUs"
                if args.gpus > machine["gpus_per_machine"] else "") + "; "
             "docs/choosing.md says how it is made):")
    return [intro] + aligned(header, rows, {0, 1, 8})


def launch_command(config: str, strategy: str, args, batch_size: int, grad_accum: int = 1,
                   gradient_checkpointing: int = 0, gpus: int | None = None, pipeline_stages: int | None = None,
                   pipeline_chunks: int = 1) -> str:
    gpus = gpus or args.gpus
    processes = "" if strategy == "model_parallel" else f" --num_processes {gpus}"
    if strategy in planner.TENSOR_PARALLEL:  # the mesh for this many GPUs (the files are written for 4)
        tp = planner.tensor_parallel_size(strategy, gpus)
        processes += f" --parallelism_config_tp_size {tp}"
        processes += f" --parallelism_config_dp_shard_size {gpus // tp}" if strategy == "fsdp_tp" else ""
    command = (f"accelerate launch --config_file {config}{processes} recipes/{args.method}.py "
               f"--batch-size {batch_size} --max-length {args.seq_len}")
    if strategy == "pipeline":  # one stage per GPU, or fewer replicated over the rest
        command += f" --pipeline-stages {pipeline_stages or gpus}"
        command += " --pipeline-schedule interleaved" if pipeline_chunks > 1 else ""  # its 2 parts: the default
    if grad_accum > 1:
        command += f" --grad-accum {grad_accum}"
    if gradient_checkpointing:
        command += " --gradient-checkpointing" + (f" {gradient_checkpointing}" if gradient_checkpointing > 1 else "")
    return command


def recommended_launch(rec: dict, args) -> str:
    return launch_command(rec["config"], rec["strategy"], args, rec["micro_batch"], rec["grad_accum"],
                          rec["gradient_checkpointing"], rec["gpus"], rec.get("pipeline_stages"),
                          rec.get("pipeline_chunks", 1))


def what_changed(rec: dict, args) -> str:
    """The flags the recommendation changes, said once."""
    changes = []
    if rec["micro_batch"] != args.batch_size:
        changes.append(f"micro-batch {rec['micro_batch']} x {rec['grad_accum']} accumulation keeps the asked "
                       f"{args.batch_size} x {args.grad_accum} per GPU")
    if rec["gradient_checkpointing"] and not args.gradient_checkpointing:
        changes.append("gradient checkpointing makes it fit (it recomputes the forward)")
    if rec["tight"]:
        changes.append("tight: above 90% of the usable memory, and nothing fits with more margin")
    return "; ".join(changes)


def sentences(shape, plan: dict, args) -> list[str]:
    rec = plan["recommendation"]
    fastest, fewest = rec["fastest"], rec["fewest_gpus"]
    if fastest is None:
        return [rec["reason"][:1].upper() + rec["reason"][1:] + "."]
    lines = [f"Launch: {recommended_launch(fastest, args)}"]
    changed = what_changed(fastest, args)
    lines.append(f"Fastest that fits on {plural(args.gpus)}: {fastest['strategy']} ({fastest['config']}), "
                 f"an estimated {seconds(fastest['seconds_per_step'])} per step, "
                 f"{seconds(fastest['seconds_per_epoch'])} per epoch" + (f"; {changed}" if changed else "") + ".")
    if fewest is not None:
        lines.append(f"Fewest GPUs: {plural(fewest['gpus'])} with {fewest['strategy']} ({fewest['config']}), "
                     f"micro-batch up to {fewest['max_micro_batch']}, an estimated "
                     f"{seconds(fewest['seconds_per_epoch'])} per epoch.")
        if fewest["gpus"] < fastest["gpus"]:
            lines.append(f"    or: {recommended_launch(fewest, args)}")
    said = set()
    for rec in (fastest, fewest):
        if rec and rec["strategy"] in planner.OFFLOADED and (rec["strategy"], rec["gpus"]) not in said:
            said.add((rec["strategy"], rec["gpus"]))
            ram = planner.cpu_offload_bytes(shape, args.method, rec["strategy"], rec["gpus"], args.lora_r,
                                            args.lora_targets, args.precision)
            machines = -(-rec["gpus"] // args.machine.gpus_per_machine)
            where = "CPU RAM" if machines == 1 else f"the CPU RAM of each of its {machines} machines"
            lines.append(f"{rec['strategy']} on {plural(rec['gpus'])} keeps about {gib(ram / machines)} GiB of "
                         f"training state in {where}.")
    loaded = set()
    for rec in (fastest, fewest):
        if rec and (rec["strategy"], rec["gpus"]) not in loaded:
            loaded.add((rec["strategy"], rec["gpus"]))
            load = host_load(shape, args, rec["strategy"], rec["gpus"])
            lines.append(f"Host RAM to load the weights, {rec['strategy']} on {plural(rec['gpus'])}: {gib(load['bytes'])} "
                         f"GiB per machine ({load['why']}).")
    return lines


def host_load(shape, args, strategy: str, gpus: int) -> dict:
    """The host RAM the weights take while they load on the busiest machine (planner.load_bytes_per_machine)."""
    return planner.load_bytes_per_machine(shape, args.method, strategy, gpus, args.machine.gpus_per_machine,
                                          args.precision)


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
    plan = planner.plan(shape, args.method, args.gpus, args.gpu_memory, batch_size=args.batch_size,
                        grad_accum=args.grad_accum, machine=args.machine, rows=args.rows, **settings)
    if args.json:
        plan["host_ram_at_load"] = {entry["strategy"]: host_load(shape, args, entry["strategy"], args.gpus)
                                    for entry in plan["strategies"]}
        print(json.dumps(plan, indent=2))
        return 0
    layouts = {e["strategy"]: planner.pipeline_layout_of(e["run"]) for e in plan["strategies"] if e["run"]}
    batches = {s: planner.max_micro_batch(shape, args.method, s, args.gpus, args.gpu_memory, **settings,
                                          grad_accum=args.grad_accum, **layouts.get(s, {}))
               for s in planner.possible_strategies(args.method, args.gpus, shape, args.lora_targets)}
    print("\n".join(describe(shape, args) + [""] + table(plan, batches) + [""] + time_table(plan, args) + [""]
                    + sentences(shape, plan, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
