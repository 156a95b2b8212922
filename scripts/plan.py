#!/usr/bin/env python
"""Will it fit, and which config? GPU memory per strategy for a model, a method and a workload.

Prints one row per config in accelerate_configs/ (weights, gradients, optimizer state and
activations on the busiest GPU, in GiB), then each config's estimated time per step and per epoch
(FLOPs at an assumed share of the GPU's peak plus the bytes the strategy moves over the link),
then the launch command of the fastest config that fits and the config that needs the fewest
GPUs: the model's hub id, --dataset YOUR_DATA (the one word to replace) and every flag the plan depends on;
whether each has run on a GPU in this project or is an estimate only; the sequence length and global batch
the ranking holds for; and the host RAM each needs per machine while the weights load. Nothing is
downloaded and no GPU is needed: the arithmetic (recipes/planner/) works from the model's config.json.

A vision-language model (its config names a vision part) is planned as the recipes' start-up `plan:` line plans
it: its vision tower and projector (counted on the model built from the config on the meta device, which needs
torch), frozen or trained (--train-vision-tower, --train-projector), and the tower's activations on a row's image
tokens (--image-tokens; default: every position of --seq-len, the worst, as the start-up line).

Examples:
    python scripts/plan.py --model tinyllama-1.1b --method lora --gpus 4 --gpu rtx6000-ada \\
        --batch-size 16 --grad-accum 2 --seq-len 1024
    python scripts/plan.py --model codellama-34b --method qlora --gpus 1 --gpu l40s \\
        --batch-size 4 --seq-len 1024 --gradient-checkpointing
    python scripts/plan.py --model codellama-34b --gpus 4 --batch-size 4 --global-batch-size 64
    python scripts/plan.py --model path/to/model_folder --method full --json
    python scripts/plan.py --model llama-3.1-8b --gpus 8 --pairs --batch-size 4 --seq-len 2048
    python scripts/plan.py --model path/to/qwen2-vl-72b/config.json --gpus 8 --seq-len 2048 --image-tokens 1024

--gpu names the card (its memory, peak and usual link); --gpu-memory only changes the memory of the card
named (an unknown card: the closest known one, with --gpu-memory, --mfu and --bandwidth).

--pairs plans preference tuning (recipes/dpo.py; with --method full, dpo_full.py): --batch-size,
--global-batch-size and --rows count pairs, each two rows (chosen and rejected) in one forward.

--model takes an offline alias (a config shipped in data/model_configs/: llama-3.1-8b, qwen2.5-72b, mixtral-8x7b, ...), a config .json, a
local model folder, or a hub id (read with transformers.AutoConfig: needs the network or the cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "recipes"))

import planner  # noqa: E402  (recipes/planner/: pure Python, no torch)

# The recipes' defaults of the flags the plan also takes (recipes/common/launching/args.py): a Launch line
# spells out only those that differ.
RECIPE_DEFAULTS = {"lora_r": 16, "lora_targets": "all-linear", "lora_dropout": 0.0, "max_length": 512,
                   "batch_size": 8, "grad_accum": 1}
# The recipes' default data is the bundled toy task: a Launch line asks for the user's, in a word the shell
# leaves as it is (the recipes refuse it, unreplaced, in one line naming the fix, before anything asks the hub).
DATASET_PLACEHOLDER = planner.DATASET_PLACEHOLDER
# --attention as the recipes spell it; sdpa is their default (transformers' choice).
RECIPE_ATTENTION = {"flash": "flash_attention_2", "eager": "eager"}


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """A refusal in one line (argparse would print the whole usage above it)."""
        self.exit(2, f"plan.py: error: {message}\n")


def parse_args(argv=None) -> argparse.Namespace:
    summary, _, details = __doc__.partition("\n")
    parser = Parser(description=summary, epilog=details, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default="tinyllama-1.1b",
        help="alias, config .json, model folder or hub id (default: tinyllama-1.1b)")
    add("--method", choices=planner.METHODS, default="lora", help="the recipe: full, lora or qlora (default: lora)")
    add("--gpus", type=int, default=4, help="GPUs available (default: 4, as the configs are set)")
    add("--gpu", default=None, metavar="NAME",
        help=f"the GPU model: {', '.join(planner.GPUS)} (default: {planner.DEFAULT_GPU}); sets the memory, "
             "the peak and the usual link")
    add("--gpu-memory", type=float, default=None,
        help="memory of one GPU in GB, as sold, instead of the --gpu's (needs --gpu: the card's peak and link "
             "come with it; the plan divides what CUDA gives of it, at the card's own ratio)")
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
    add("--batch-size", type=int, default=RECIPE_DEFAULTS["batch_size"],
        help="micro-batch per GPU, the recipes' --batch-size; with --global-batch-size the largest tried "
             "(default: 8)")
    add("--grad-accum", type=int, default=None, help="micro-batches per optimizer step, the recipes' --grad-accum "
                                                     "(default: 1)")
    add("--global-batch-size", type=int, default=None, metavar="ROWS",
        help="rows per optimizer step on every config alike, as the recipes' --global-batch-size: each config "
             "runs micro-batch x accumulation x its data-parallel processes = ROWS (default: --batch-size x "
             "--grad-accum per GPU, so a pipeline's or model parallel's global batch is smaller)")
    add("--rows", type=int, default=1024, help="sequences in an epoch, for the time per epoch (default: 1024)")
    add("--seq-len", type=int, default=RECIPE_DEFAULTS["max_length"],
        help="tokens per sequence, the recipes' --max-length (default: 512)")
    add("--gradient-checkpointing", nargs="?", type=int, const=1, default=0, metavar="EVERY_N",
        help="the recipes' --gradient-checkpointing (bare: every layer, N: every Nth layer)")
    add("--lora-r", type=int, default=RECIPE_DEFAULTS["lora_r"], help="adapter rank (default: 16, as the recipes)")
    add("--lora-targets", default=RECIPE_DEFAULTS["lora_targets"],
        help="comma-separated module names, or all-linear (default)")
    add("--lora-dropout", type=float, default=RECIPE_DEFAULTS["lora_dropout"],
        help="adapter dropout; its input copies and masks cost memory (default: 0)")
    add("--use-dora", action="store_true",
        help="DoRA (the recipes' --use-dora): each adapted layer keeps two more outputs for the backward")
    add("--precision", choices=("bf16", "fp32"), default="bf16",
        help="bf16 (the configs' mixed precision) or fp32 (--mixed_precision no)")
    add("--attention", choices=planner.ATTENTIONS, default="sdpa", help="attention implementation (default: sdpa)")
    add("--host-ram", type=float, default=None, metavar="GIB",
        help="RAM of each machine in GiB: no config whose weights outgrow it while they load is recommended "
             "(default: not weighed; every recipe checks its own machine at start-up)")
    add("--pairs", action="store_true",
        help="preference tuning (recipes/dpo.py, dpo_full.py): batches and --rows count pairs of two rows, "
             "and LoRA / QLoRA run the reference's forward in each step")
    add("--train-vision-tower", action="store_true",
        help="a vision-language model: the recipes' --train-vision-tower (LoRA: adapters on the tower; full: all of it)")
    add("--train-projector", action="store_true", help="a vision-language model: the recipes' --train-projector")
    add("--image-tokens", type=int, default=None, metavar="N",
        help="a vision-language model: image tokens in a row, which the vision tower encodes (default: every "
             "position of --seq-len, the worst, as the recipes' start-up plan line)")
    add("--json", action="store_true", help="print the plan as JSON instead of the table")
    args = parser.parse_args(argv)
    if args.global_batch_size is not None and args.grad_accum is not None:
        parser.error("--global-batch-size sets each config's accumulation; drop --grad-accum")
    if args.grad_accum is None:
        args.grad_accum = RECIPE_DEFAULTS["grad_accum"]
    if args.host_ram is not None and args.host_ram <= 0:
        parser.error("--host-ram must be > 0")
    for name in ("gpus", "batch_size", "seq_len", "lora_r", "grad_accum", "rows", "global_batch_size", "image_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.image_tokens is not None and args.image_tokens > args.seq_len:
        parser.error(f"--image-tokens {args.image_tokens} is more than a row holds (--seq-len {args.seq_len})")
    if args.gpu_memory is not None and args.gpu is None:
        parser.error(memory_without_card(args.gpu_memory))
    args.gpu = args.gpu or planner.DEFAULT_GPU
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
    args.memory_gib = args.machine.gpu.memory_gib(args.gpu_memory)  # what the arithmetic divides
    return args


def memory_without_card(memory: float) -> str:
    """The refusal of --gpu-memory alone: it would keep the default card's peak and link, and no memory names
    one card (48 GB is an A6000, an RTX 6000 Ada, an L40S, and cards the planner does not know)."""
    cards = planner.cards_of_memory(memory)
    known = f"{memory:g} GB: {', '.join(cards)}; " if cards else ""
    return (f"--gpu-memory {memory:g} without --gpu would plan the default {planner.GPUS[planner.DEFAULT_GPU].name}'s peak "
            f"and link: name the card with --gpu ({known}all: {', '.join(planner.GPUS)}); --gpu-memory then changes only "
            "its memory")


def examples(args) -> str:
    """What a batch counts: rows, or the preference recipes' pairs."""
    return "pairs" if args.pairs else "rows"


def recipe_file(args) -> str:
    """The recipe a Launch line runs (with the flags that pick its variant)."""
    if not args.pairs:
        return f"recipes/{args.method}.py"
    return {"full": "recipes/dpo_full.py", "lora": "recipes/dpo.py", "qlora": "recipes/dpo.py --bits 4"}[args.method]


def gib(value: float) -> str:
    return f"{value / planner.GiB:.2f}"


def count(value: int) -> str:
    return f"{value / 1e9:.2f} B" if value >= 1e9 else f"{value / 1e6:.2f} M"


def vision_side(shape, args):
    """A vision-language model's vision tower and projector as the recipes' start-up plan line counts them
    (memory_plan.vision_shape: on the model built from its config on the meta device, no weights); None for a text
    model or where transformers finds no tower (`vision_line` says so). Raises ValueError, as the recipes refuse,
    for a vision flag on a text model or a tower --lora-targets adapts nothing of."""
    asked = [flag for flag, on in (("--train-vision-tower", args.train_vision_tower),
                                   ("--train-projector", args.train_projector)) if on]
    if not shape.reads_images:
        if asked:
            raise ValueError(f"{' and '.join(asked)}: --model {args.model} reads text only (its config names no "
                             f"vision part); drop {'them' if len(asked) > 1 else 'it'}, or give an image-text-to-text "
                             "model")
        return None
    # torch and transformers load here only: a text model's plan needs neither
    from common.launching.memory_plan import vision_shape

    asks = argparse.Namespace(model=planner.config_source(args.model), trust_remote_code=False,
                              lora_targets=args.lora_targets, train_vision_tower=args.train_vision_tower,
                              train_projector=args.train_projector)
    try:
        vision = vision_shape(asks, args.method)
    except Exception:  # noqa: BLE001  (a family whose tower cannot be measured so, as the start-up line: said)
        return None
    if vision is not None and args.train_vision_tower and args.method != "full" and not vision.adapted:
        raise ValueError(f"--train-vision-tower: --lora-targets {args.lora_targets} names no linear layer of the "
                         "vision tower; add some of them, or use all-linear")
    return vision


def vision_line(shape, vision, args) -> list[str]:
    """What the plan counts of a vision-language model's vision side, in a line ([] for a text model)."""
    if not shape.reads_images:
        return []
    if vision is None:
        return ["vision: its vision tower, projector and images are not in this plan (transformers finds no tower "
                "in the model built from its config)"]
    trained = [part for part, on in (("tower", args.train_vision_tower), ("projector", args.train_projector)) if on]
    count_ = planner.vision_parameters(vision, args.method, args.lora_r, args.train_vision_tower,
                                       args.train_projector)["trained"]
    how = f"the {' and '.join(trained)} trained ({count(count_)} trainable parameters)" if trained else "frozen"
    rows = args.batch_size * (2 if args.pairs else 1)
    if vision.patches_per_row:
        images = "one image a row at its most tiles, read beside the row by cross-attention"
    elif args.image_tokens:
        images = f"--image-tokens {args.image_tokens} a row"
    else:
        images = ("every position of --seq-len an image token, the worst, as the recipes' start-up line; "
                  "--image-tokens N plans N a row")
    return [f"vision: tower {count(vision.tower + vision.unread)}, projector {count(vision.projector)} parameters, "
            f"{how}; the tower encodes up to {vision.patches(rows, args.image_tokens or args.seq_len):,} patches a "
            f"micro-batch ({images}); in every memory and host RAM figure below, not in the time"]


def describe(shape, args) -> list[str]:
    method = args.method
    if method != "full":
        trainable = planner.lora_parameters(shape, args.lora_r, args.lora_targets)
        method += f", r={args.lora_r}, {args.lora_targets} ({count(trainable)} trainable)"
    every = args.gradient_checkpointing
    checkpointing = ("no gradient checkpointing" if not every else "gradient checkpointing"
                     + (f" of one layer in {every}" if every > 1 else ""))
    unit = " pairs" if args.pairs else ""
    micro = f"micro-batch {args.batch_size}{unit}"
    accum = f", {args.grad_accum} micro-batches per step" if args.grad_accum > 1 else ""
    if args.global_batch_size:
        micro = f"micro-batch up to {args.batch_size}{unit}"
        accum = (f", global batch {args.global_batch_size} {examples(args)} a step on every config (micro-batch x "
                 "accumulation x data-parallel processes)")
    if args.pairs:
        method += ("; preference pairs, two rows each in one forward" +
                   (", the reference scored once before training" if args.method == "full" else
                    ", the reference's forward (adapters off) in every micro-batch"))
    return [
        f"model: {shape.name} ({count(shape.parameters)} parameters{' in its language model' * shape.reads_images}); "
        f"method: {method}",
        f"workload: {micro} x {args.seq_len} tokens per GPU{accum}, {args.precision}, "
        f"{args.attention} attention, {checkpointing}",
        f"GPUs: {args.gpus} x {args.machine.gpu.name}, {args.gpu_memory:g} GB each ({args.memory_gib:.2f} GiB as CUDA "
        f"gives it); a plan may use {gib(planner.usable_bytes(args.memory_gib))} GiB of each (10% stays free for the "
        "CUDA context and fragmentation)",
    ] + vision_line(shape, args.vision, args)


def aligned(header: list[str], rows: list[list[str]], left: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]

    def line(cells):
        padded = (cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    return [line(header)] + [line(row) for row in rows]


def checkpointing(every: int) -> str:
    return "no" if not every else "yes" if every == 1 else f"1 in {every}"


def table(plan: dict, args) -> list[str]:
    vision = args.vision is not None  # a column of what the vision side adds, already in the others
    header = ["strategy", "config", "checkpointing", "weights", "grads", "optimizer", "activations", "total",
              *["of it vision"] * vision, "fits", "max micro-batch"]
    rows = []
    for entry in plan["strategies"]:
        usage = entry["per_gpu_bytes"]
        rows.append([entry["strategy"], entry["config"], checkpointing(entry["gradient_checkpointing"]),
                     gib(usage["weights"]), gib(usage["gradients"]), gib(usage["optimizer"]),
                     gib(usage["activations"]), gib(usage["total"]), *[gib(usage.get("vision", 0))] * vision,
                     "yes" if entry["fits"] else "no", str(entry["max_micro_batch"] or "-")])
    # the time table's checkpointing, so that neither says what the other does not plan
    title = (f"Memory of the busiest GPU in GiB, at micro-batch {args.batch_size}, with gradient checkpointing as the "
             "time table below plans it" + ("" if args.gradient_checkpointing else " (on only where a config fits "
                                            "with it alone)"))
    if plan["gpus"] == 1:
        title += ("; one GPU runs ddp.yaml as a single process, or an offload config: ZeRO, FSDP's sharding and "
                  "model parallel have nothing to divide on one")
    return [title + ":"] + aligned(header, rows, {0, 1, 2, 9 if vision else 8}) + grad_op_note(plan)


def grad_op_note(plan: dict) -> list[str]:
    """Why fsdp_grad_op plans more weight memory than ddp, where it does: [] otherwise."""
    weights = {entry["strategy"]: entry["per_gpu_bytes"]["weights"] for entry in plan["strategies"]}
    if weights.get("fsdp_grad_op", 0) <= weights.get("ddp", float("inf")):
        return []
    return ["fsdp_grad_op's weights: its shard of every weight, and the whole weights gathered at the forward and "
            "kept to the backward (not freed layer by layer as fsdp.yaml does): more than ddp's one copy; it saves "
            "on gradients and optimizer state"]


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
    """How a pipeline or sequence parallel run splits the GPUs ('' for the other strategies)."""
    if "sequence_parallel" in run:
        group = run["sequence_parallel"]
        return f"rows split over groups of {group}" + (f", {gpus // group} groups" if group < gpus else "")
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
            note.append(f"tight: {run['total_bytes'] / planner.usable_bytes(args.memory_gib):.0%} of usable memory")
        rows.append([entry["strategy"], runs_as(run, args.gpus), str(run["global_batch"]), seconds(time["compute"]),
                     seconds(time["communication"]), seconds(time["other"]), seconds(time["step"]),
                     seconds(run["seconds_per_epoch"]), "; ".join(note)])
    rows += [[e["strategy"], "cannot run it" if e["refusal"] else "does not fit", "", "", "", "", "", "",
              e["refusal"] or ""] for e in plan["strategies"] if not e["run"]]
    intro = (f"Time per optimizer step and per epoch of {machine['rows']:,} {examples(args)}, fastest first (an estimate: "
             f"{machine['mfu']:.0%} of {machine['gpu']}'s {machine['peak_tflops']:g} TFLOP/s {args.precision} peak; "
             f"collectives at {machine['bandwidth_gb_s']:g} GB/s over {machine['link']}"
             + (f", at {machine['network_gb_s']:g} GB/s over the network beyond {machine['gpus_per_machine']} GPUs"
                if args.gpus > machine["gpus_per_machine"] else "") + "; "
             "docs/choosing.md says how it is made):")
    return [intro] + aligned(header, rows, {0, 1, 8})


def model_flag(args) -> str:
    """--model as the recipes take it: an alias's hub id, a folder or hub id as given (quoted for the shell)."""
    model = planner.launch_model(args.model)
    return model if model == planner.MODEL_PLACEHOLDER else shlex.quote(model)


def recommended_launch(rec: dict, args) -> str:
    """The `accelerate launch` line of a recommended run. It names the model and asks for the data (the
    recipes' defaults are the bundled tiny model and toy data) and spells out every flag the plan
    depends on that the config file or the recipe's default would not give."""
    strategy, gpus = rec["strategy"], rec["gpus"]
    launcher = [f"--config_file {rec['config']}"]
    if strategy != "model_parallel":  # one process that sees the GPUs
        launcher.append(f"--num_processes {gpus}")
    if strategy in planner.TENSOR_PARALLEL:  # the mesh for this many GPUs (the files are written for 4)
        tp = planner.tensor_parallel_size(strategy, gpus)
        launcher.append(f"--parallelism_config_tp_size {tp}")
        if strategy == "fsdp_tp":
            launcher.append(f"--parallelism_config_dp_shard_size {gpus // tp}")
    if strategy == "sp":  # the group that splits each row (the file's is 2)
        launcher.append(f"--parallelism_config_sp_size {rec['sequence_parallel']}")
    if args.precision == "fp32":  # the configs set mixed_precision: bf16
        launcher.append("--mixed_precision no")
    recipe = [f"--model {model_flag(args)}", f"--dataset {DATASET_PLACEHOLDER}", f"--batch-size {rec['micro_batch']}"]
    if args.global_batch_size:  # the recipe works out the same accumulation from it
        recipe.append(f"--global-batch-size {args.global_batch_size}")
    recipe.append(f"--max-length {args.seq_len}")
    if strategy == "pipeline":  # one stage per GPU, or fewer replicated over the rest
        recipe.append(f"--pipeline-stages {rec.get('pipeline_stages') or gpus}")
        if rec.get("pipeline_chunks", 1) > 1:  # its 2 parts: the recipes' --pipeline-chunks default
            recipe.append("--pipeline-schedule interleaved")
    if rec["grad_accum"] > 1 and not args.global_batch_size:
        recipe.append(f"--grad-accum {rec['grad_accum']}")
    every = rec["gradient_checkpointing"]
    if every:
        recipe.append("--gradient-checkpointing" + (f" {every}" if every > 1 else ""))
    if args.method != "full":
        if args.lora_r != RECIPE_DEFAULTS["lora_r"]:
            recipe.append(f"--lora-r {args.lora_r}")
        if args.lora_targets != RECIPE_DEFAULTS["lora_targets"]:
            recipe.append(f"--lora-targets {shlex.quote(args.lora_targets)}")
        if args.lora_dropout != RECIPE_DEFAULTS["lora_dropout"]:
            recipe.append(f"--lora-dropout {args.lora_dropout:g}")
        if args.use_dora:
            recipe.append("--use-dora")
    if args.attention in RECIPE_ATTENTION:
        recipe.append(f"--attention {RECIPE_ATTENTION[args.attention]}")
    recipe += ["--train-vision-tower"] * args.train_vision_tower + ["--train-projector"] * args.train_projector
    return f"accelerate launch {' '.join(launcher)} {recipe_file(args)} {' '.join(recipe)}"


def global_batch(rec: dict, args) -> str:
    return f"global batch {rec['global_batch']} {examples(args)} a step"


def batch_of(rec: dict, args) -> str:
    """A recommendation's batch as it runs, and the largest micro-batch its GPUs hold at its checkpointing (on
    fewer GPUs than the tables' rows, so said with its GPUs)."""
    every = rec["gradient_checkpointing"]
    recomputed = f", gradient checkpointing{'' if every == 1 else f' of one layer in {every}'}" if every else ""
    ranks = planner.data_parallel_size(rec["strategy"], rec["gpus"], rec.get("pipeline_stages"),
                                       rec.get("sequence_parallel"))
    unit = (" pair" if rec["micro_batch"] == 1 else " pairs") if args.pairs else ""
    return (f"micro-batch {rec['micro_batch']}{unit} x {rec['grad_accum']} accumulation x {ranks} data-parallel "
            f"process{'es' if ranks > 1 else ''}{recomputed}: {global_batch(rec, args)} (a micro-batch of up to "
            f"{rec['max_micro_batch']} fits {'each of its GPUs' if rec['gpus'] > 1 else 'the GPU'} so)")


def what_changed(rec: dict, plan: dict, args) -> str:
    """The flags the recommendation changes, said once."""
    changes = []
    if args.global_batch_size:
        ranks = planner.data_parallel_size(rec["strategy"], rec["gpus"], rec.get("pipeline_stages"),
                                           rec.get("sequence_parallel"))
        changes.append(f"micro-batch {rec['micro_batch']} x {rec['grad_accum']} accumulation x {ranks} data-parallel "
                       f"process{'es' if ranks > 1 else ''}")
    elif rec["micro_batch"] != args.batch_size:
        changes.append(f"micro-batch {rec['micro_batch']} x {rec['grad_accum']} accumulation keeps the asked "
                       f"{args.batch_size} x {args.grad_accum} per GPU")
    batches = {entry["run"]["global_batch"] for entry in plan["strategies"] if entry["run"]}
    if len(batches) > 1:  # a pipeline's replicas and model parallel run fewer rows than data parallel does
        asked = args.batch_size * args.grad_accum * args.gpus
        changes.append(f"the configs' global batches differ ({min(batches)} to {max(batches)} {examples(args)} a step): "
                       f"--global-batch-size {asked} plans them all at the asked {args.batch_size} x "
                       f"{args.grad_accum} on each of {plural(args.gpus)}")
    if rec["gradient_checkpointing"] and not args.gradient_checkpointing:
        changes.append("gradient checkpointing makes it fit (it recomputes the forward)")
    if rec["tight"]:
        changes.append("tight: above 90% of the usable memory, and nothing fits with more margin")
    return "; ".join(changes)


def placeholders(args) -> str:
    """What to put in place of the Launch line's placeholder words."""
    model = (f" and {planner.MODEL_PLACEHOLDER} with the hub id or folder of this model's weights"
             if model_flag(args) == planner.MODEL_PLACEHOLDER else "")
    return f"(replace {DATASET_PLACEHOLDER} with your data file, folder or hub id{',' if model else ''}{model})"


def ranked_for(args) -> str:
    """The inputs the ranking holds for: another sequence length or global batch can put another config first."""
    batch = (f"--global-batch-size {args.global_batch_size}" if args.global_batch_size else
             f"--batch-size {args.batch_size} x --grad-accum {args.grad_accum} per data-parallel process")
    return (f"Ranked for --seq-len {args.seq_len} and {batch}: a different sequence length or global batch can put "
            "another config first.")


def launched(plan: dict) -> list[dict]:
    """The recommendations a Launch or `or:` line launches, first the one launched first: on all the GPUs the
    fastest or the fastest that has run on a GPU (the other beside it), then the fewest GPUs' when fewer."""
    rec = plan["recommendation"]
    if rec["fastest"] is None:
        return []
    pair = [rec["fastest"]] + ([rec["tested"]] if rec["tested"] else [])
    runs = pair[::-1] if rec["first"] == "tested" else pair
    fewest = rec["fewest_gpus"]
    return runs + ([fewest] if fewest and fewest["gpus"] < rec["fastest"]["gpus"] else [])


def beside_line(first: dict, other: dict, args) -> str:
    """Why the other of the fastest and the fastest tested is not launched first, in one line."""
    ratio = other["seconds_per_epoch"] / first["seconds_per_epoch"]
    rule = (f"a config no GPU has run here is launched first only when its estimate is {planner.CLEARLY_FASTER:g}x the "
            "speed of the fastest that has run (where measured, the estimate's ratios came within 30%)")
    if other["strategy"] in planner.RAN_ON_GPU:
        ran = planner.RAN_ON_GPU[other["strategy"]]
        return (f"Tested instead: {other['strategy']} ({other['config']}), {seconds(other['seconds_per_epoch'])} per "
                f"epoch ({ratio:.2f}x slower by the estimate), {global_batch(other, args)}; it has run on "
                f"{plural(ran.gpus)} in this project ({ran.results}), {first['strategy']} never: {rule}.")
    return (f"Faster by the estimate: {other['strategy']} ({other['config']}), {seconds(other['seconds_per_epoch'])} "
            f"per epoch ({1 / ratio:.2f}x faster), {global_batch(other, args)}; it has not run on a GPU in this project: "
            f"{rule}.")


def sentences(shape, plan: dict, args) -> list[str]:
    rec = plan["recommendation"]
    fewest = rec["fewest_gpus"]
    if rec["fastest"] is None:
        return [rec["reason"][:1].upper() + rec["reason"][1:] + "."]
    first, *others = launched(plan)
    other = others[0] if rec["tested"] else None
    lines = [f"Launch: {recommended_launch(first, args)}", f"    {placeholders(args)}"]
    changed = what_changed(first, plan, args)
    which = "Fastest that fits" if first is rec["fastest"] else "Fastest tested that fits"
    lines.append(f"{which} on {plural(args.gpus)}: {first['strategy']} ({first['config']}), "
                 f"{global_batch(first, args)}, an estimated {seconds(first['seconds_per_step'])} per step, "
                 f"{seconds(first['seconds_per_epoch'])} per epoch" + (f"; {changed}" if changed else "") + ". "
                 + planner.gpu_evidence(first["strategy"], first["gpus"]))
    lines.append(ranked_for(args))
    if other:
        lines += [beside_line(first, other, args), f"    or: {recommended_launch(other, args)}"]
    if "reference_pass_seconds" in first:
        lines.append(f"Before its first step dpo_full.py scores the {args.rows:,} pairs with the model as loaded: about "
                     f"{seconds(first['reference_pass_seconds'])} (once; a rerun or resume reads the scores back).")
    if fewest is not None:
        lines.append(f"Fewest GPUs: {plural(fewest['gpus'])} with {fewest['strategy']} ({fewest['config']}), "
                     f"{batch_of(fewest, args)}, an estimated {seconds(fewest['seconds_per_epoch'])} per epoch. "
                     + planner.gpu_evidence(fewest["strategy"], fewest["gpus"]))
        if fewest["gpus"] < first["gpus"]:
            lines.append(f"    or: {recommended_launch(fewest, args)}")
    said = set()
    for rec in (first, fewest):
        if rec and rec["strategy"] in planner.OFFLOADED and (rec["strategy"], rec["gpus"]) not in said:
            said.add((rec["strategy"], rec["gpus"]))
            ram = planner.cpu_offload_bytes(shape, args.method, rec["strategy"], rec["gpus"], args.lora_r,
                                            args.lora_targets, args.precision) + offloaded_vision(args, rec["strategy"])
            machines = -(-rec["gpus"] // args.machine.gpus_per_machine)
            where = "CPU RAM" if machines == 1 else f"the CPU RAM of each of its {machines} machines"
            lines.append(f"{rec['strategy']} on {plural(rec['gpus'])} keeps about {gib(ram / machines)} GiB of "
                         f"training state in {where}.")
    cannot_load = plan["cannot_load"]
    if cannot_load:
        lines.append(f"Not recommended, their weights outgrow --host-ram {args.host_ram:g} GiB while they load: "
                     + ", ".join(f"{strategy} ({gib(size)} GiB per machine)" for strategy, size in cannot_load.items())
                     + ".")
    loaded = set()
    for rec in (first, fewest):
        if rec and (rec["strategy"], rec["gpus"]) not in loaded:
            loaded.add((rec["strategy"], rec["gpus"]))
            load = host_load(shape, args, rec["strategy"], rec["gpus"])
            lines.append(f"Host RAM to load the weights, {rec['strategy']} on {plural(rec['gpus'])}: {gib(load['bytes'])} "
                         f"GiB per machine ({load['why']}).")
    return lines


def offloaded_vision(args, strategy: str) -> int:
    """The training state of a vision-language model's vision side an offload config keeps in CPU RAM: all of it,
    as its twin (fsdp.yaml, zero3.yaml) holds it on one rank."""
    if args.vision is None:
        return 0
    state = planner.vision_bytes(args.vision, args.method, planner.OFFLOADED[strategy], 1, 1, 1, args.lora_r,
                                 args.precision, args.train_vision_tower, args.train_projector)
    return state["weights"] + state["gradients"] + state["optimizer"]


def host_load(shape, args, strategy: str, gpus: int) -> dict:
    """The host RAM the weights take while they load on the busiest machine (planner.load_bytes_per_machine)."""
    return planner.load_bytes_per_machine(shape, args.method, strategy, gpus, args.machine.gpus_per_machine,
                                          args.precision, vision=args.vision)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        shape = planner.load_shape(args.model)
        args.vision = vision_side(shape, args)
    except ValueError as error:
        print(f"plan.py: {error}", file=sys.stderr)
        return 2
    settings = dict(seq_len=args.seq_len, gradient_checkpointing=args.gradient_checkpointing, lora_rank=args.lora_r,
                    lora_targets=args.lora_targets, precision=args.precision, attention=args.attention,
                    lora_dropout=args.lora_dropout, dora=args.use_dora and args.method != "full", vision=args.vision,
                    train_vision_tower=args.train_vision_tower, train_projector=args.train_projector,
                    image_tokens=args.image_tokens)
    plan = planner.plan(shape, args.method, args.gpus, args.memory_gib, batch_size=args.batch_size,
                        grad_accum=args.grad_accum, machine=args.machine, rows=args.rows,
                        global_batch=args.global_batch_size, host_ram_gb=args.host_ram, pairs=args.pairs, **settings)
    refusals = [entry["refusal"] for entry in plan["strategies"]]
    if refusals and all(refusals):  # no config can run this global batch on these GPUs
        print(f"plan.py: {refusals[0]}", file=sys.stderr)
        return 2
    for rec in plan["recommendation"].values():
        if isinstance(rec, dict):
            rec["launch"] = recommended_launch(rec, args)
            ran = planner.RAN_ON_GPU.get(rec["strategy"])  # None: an estimate only
            rec["ran_on_gpu"] = {"gpus": ran.gpus, "results": ran.results} if ran else None
    if args.json:
        plan["gpu_memory_gb"] = args.gpu_memory  # as sold; the plan divides gpu_memory_gib
        plan["host_ram_at_load"] = {entry["strategy"]: host_load(shape, args, entry["strategy"], args.gpus)
                                    for entry in plan["strategies"]}
        if shape.reads_images:  # the vision side as planned (None: not counted)
            plan["vision"] = args.vision and {
                **dataclasses.asdict(args.vision), "image_tokens": args.image_tokens or args.seq_len,
                "train_vision_tower": args.train_vision_tower, "train_projector": args.train_projector,
                **planner.vision_parameters(args.vision, args.method, args.lora_r, args.train_vision_tower,
                                            args.train_projector)}
        print(json.dumps(plan, indent=2))
        return 0
    print("\n".join(describe(shape, args) + [""] + table(plan, args) + [""] + time_table(plan, args) + [""]
                    + sentences(shape, plan, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
