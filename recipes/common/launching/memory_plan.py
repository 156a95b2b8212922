"""The memory plan of this very run: the planner's inputs read from the run (the same arithmetic as
`scripts/plan.py`), the `plan:` line every launch prints before loading, and the refusal of a launch
whose weights cannot pass through this machine's host RAM.
"""

from __future__ import annotations

import os

import torch

import planner

from ..model.model_config import is_default_model, meta_model, model_config_object, vision_language
from ..model.vision import tower_linears, vision_parameters, vision_parts
from ..refusal import refuse
from .args import ONLINE_RECIPES, PREFERENCE_RECIPES
from .args import lora_targets as target_names


def planner_inputs(args, recipe: str, launch) -> tuple:
    """The model's shape and the planner's keyword arguments for this run (all but the micro-batch).
    Raises when the shape cannot be read (an offline hub id, an unknown architecture)."""
    source = "tiny-llama" if is_default_model(args.model) else args.model  # before its first build
    shape = planner.load_shape(source)
    # compiled blocks keep less (--compile, or a config file's); undecided yet (the default, decided by the planned
    # steps after the data) plans eager: the larger of the two
    inputs = dict(seq_len=args.max_length, gradient_checkpointing=args.gradient_checkpointing,
                  precision="bf16" if launch.precision in ("bf16", "fp16") else "fp32", compiled=bool(args.compile))
    if launch.planner_strategy == "sp":  # the planner's sp: zero3 at the length of each rank's slice
        inputs["sequence_parallel"] = launch.sequence_parallel
    elif launch.sequence_parallel > 1:  # ZeRO-1 or 2 under sequence parallel: their stage at a slice's length
        inputs["seq_len"] = -(-args.max_length // launch.sequence_parallel)
    if recipe != "full":
        inputs.update(lora_rank=args.lora_r, lora_targets=args.lora_targets, lora_dropout=args.lora_dropout,
                      dora=args.use_dora)
    try:
        vision = vision_shape(args, recipe)
    except Exception:  # noqa: BLE001  (a family whose tower cannot be measured so: the line says it is not counted)
        vision = None
    if vision is not None:
        inputs.update(vision=vision, train_vision_tower=bool(getattr(args, "train_vision_tower", False)),
                      train_projector=bool(getattr(args, "train_projector", False)))
    return shape, inputs


def vision_shape(args, recipe: str) -> planner.VisionShape | None:
    """A vision-language model's vision tower and projector as the planner takes them (planner/vision.py), counted
    on the model built from its config (no weights): their parameters, the tower's blocks (their width: the
    narrowest input of their linear layers; their MLP's: the widest), the values of a patch its first layer reads,
    and the patches it encodes for each image token of a row. None for a text model, or where the tower is not found."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    config = model_config_object(args.model, getattr(args, "trust_remote_code", False))
    if config is None or not vision_language(config):
        return None
    model = meta_model(args.model, getattr(args, "trust_remote_code", False))
    parts = vision_parts(model) if model is not None else None
    if parts is None:
        return None
    tower_name, projector = parts
    tower, params = model.get_submodule(tower_name), vision_parameters(model)
    inside = tuple(f"{name}." for name in projector)
    named = [(name, module) for name, module in tower.named_modules(prefix=tower_name) if not f"{name}.".startswith(inside)]
    blocks = [module for _, module in named if isinstance(module, GradientCheckpointingLayer)]
    if not blocks:  # (mllama's) the most numerous of the classes FSDP wraps whole
        kinds = [type(module).__name__ for _, module in named if type(module).__name__ in model._no_split_modules]
        blocks = [module for _, module in named if kinds and type(module).__name__ == max(kinds, key=kinds.count)]
    widths = [layer.in_features for layer in (blocks[0].modules() if blocks else ()) if isinstance(layer, torch.nn.Linear)]
    if not widths:
        return None
    first = next((module for module in tower.modules()
                  if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear))), None)
    adapted = ()
    if recipe != "full" and getattr(args, "train_vision_tower", False):
        chosen = set(tower_linears(model, target_names(args.lora_targets)))
        adapted = tuple((module.in_features, module.out_features) for name, module in model.named_modules()
                        if name in chosen)
    return planner.VisionShape(
        tower=sum(param.numel() for param in params["tower"]), projector=sum(param.numel() for param in params["projector"]),
        unread=sum(param.numel() for param in params["unread"]),
        hidden=min(widths), ffn=max(widths), layers=len(blocks),
        patch_values=first.weight[0].numel() if first is not None else min(widths),
        patches_per_token=patches_per_token(config), patches_per_row=patches_per_row(config), adapted=adapted)


def patches_per_token(config) -> float:
    """The patches a vision tower encodes for each image token it gives the language model, from the config: a
    spatial merge (Qwen2-VL: 2 x 2 patches a token), Gemma 3's pooling to mm_tokens_per_image, Idefics3's and
    SmolVLM's pixel shuffle (scale_factor^2), else one token a patch (LLaVA, PaliGemma)."""
    vision = config.vision_config
    if getattr(vision, "spatial_merge_size", None):
        return float(vision.spatial_merge_size ** 2)
    if getattr(config, "mm_tokens_per_image", None) and getattr(vision, "image_size", None):
        return (vision.image_size // vision.patch_size) ** 2 / config.mm_tokens_per_image
    if getattr(config, "scale_factor", None):
        return float(config.scale_factor ** 2)
    return 1.0


def patches_per_row(config) -> int:
    """A model whose language model reads the images through cross-attention (mllama), not as tokens of the row: the
    patches of one image at its most tiles, taken as a row's; 0 for the others."""
    vision = config.vision_config
    if not getattr(config.get_text_config(), "cross_attention_layers", None):
        return 0
    per_tile = (vision.image_size // vision.patch_size) ** 2 + 1  # and its class token
    return per_tile * getattr(vision, "max_num_tiles", 1)


def card_flags(device_name: str, memory_gib: float) -> str:
    """plan.py's flags for this GPU: its card by name (a plain word to replace where the planner does not
    know it) and its memory."""
    return f"--gpu {planner.card_of_device(device_name) or 'YOUR_GPU'} --gpu-memory {memory_gib:.0f}"


def announce_plan(args, recipe: str, launch) -> None:
    """Print the memory plan of this very run, and warn before loading when it will not fit; refuse
    (every rank) when the weights cannot load in this machine's host RAM."""
    main = int(os.environ.get("RANK", "0")) == 0
    try:
        shape, inputs = planner_inputs(args, recipe, launch)
    except Exception as error:  # offline hub id, unknown architecture: a courtesy, never a blocker
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        if main:
            print(f"plan: skipped ({reason})", flush=True)
        return
    load = host_load(shape, recipe, launch, inputs["precision"], inputs.get("vision"))
    check_host_ram(load, machine_ram_bytes(), args.model)
    if not main:
        return
    strategy, gpus = launch.planner_strategy, launch.gpus
    layout = dict(pipeline_stages=launch.pipeline_stages, pipeline_chunks=launch.pipeline_chunks) \
        if launch.pipeline_stages > 1 else {}
    try:
        pairs = getattr(args, "recipe", None) in PREFERENCE_RECIPES  # two rows a pair in one forward
        # an online recipe samples --batch-size x --grad-accum completions at once, with the whole model
        sampled = args.batch_size * args.grad_accum if getattr(args, "recipe", None) in ONLINE_RECIPES else 0
        # grpo_full.py's reference under --beta: the weights as loaded, one more copy of a GPU's share
        starting_copy = getattr(args, "recipe", None) == "grpo_full" and bool(getattr(args, "beta", 0))
        need = planner.per_gpu_bytes(shape, recipe, strategy, gpus, batch_size=args.batch_size, **inputs,
                                     grad_accum=args.grad_accum, **layout, pairs=pairs, generation_rows=sampled,
                                     starting_copy=starting_copy)
    except ValueError as error:  # e.g. LoRA targets the planner does not know
        print(f"plan: skipped ({str(error).splitlines()[0]})", flush=True)
        return
    parts = ", ".join(f"{key} {size(need[key])}" for key in ("weights", "gradients", "optimizer", "activations",
                                                               "reference") if key in need)
    if "generation" in need:  # the peak while sampling: the whole model and the KV cache of every completion
        parts += f"; sampling {size(need['generation'])}"
    ran = getattr(args, "recipe", recipe)
    name = recipe if ran == recipe else f"{ran} ({recipe})"  # dpo.py settled as LoRA: "dpo (lora)"
    per = "per GPU" if launch.on_gpu else "per process (a GPU's share, planned as on a GPU)"
    sliced = (f" ({-(-args.max_length // launch.sequence_parallel)} positions a rank)"
              if launch.sequence_parallel > 1 else "")
    line = (f"plan: {name} with {strategy} on {gpus} process(es): {size(need['total'])} {per} ({parts}) "
            f"at --max-length {args.max_length}{' (two rows a pair)' if pairs else ''}{sliced}; host RAM to load the weights: {size(load['bytes'])} on this "
            f"machine ({load['why']})")
    if "vision" in need:
        line += "; " + vision_words(inputs["vision"], need["vision"], args.batch_size, args.max_length, inputs)
    elif vision_language_model(args):  # its tower could not be found and counted: said, not hidden
        line += "; its vision tower, projector and images are not in this plan"
    if not launch.on_gpu:
        print(line, flush=True)
        return
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / planner.GiB
    print(f"{line}; the GPU has {gpu_gib:.0f} GiB", flush=True)
    if not planner.fits(need["total"], gpu_gib):
        print(f"warning: the plan says this will not fit; see `python scripts/plan.py --model {args.model} "
              f"--method {recipe} --gpus {gpus} {card_flags(torch.cuda.get_device_name(0), gpu_gib)} "
              f"--batch-size {args.batch_size} "
              f"--seq-len {args.max_length}{' --pairs' if pairs else ''}{vision_flags(inputs)}` for a config and "
              "micro-batch that fit", flush=True)


def vision_words(vision: planner.VisionShape, added: int, batch_size: int, max_length: int, inputs: dict) -> str:
    """What the plan counts of a vision-language model's vision side, in a few words."""
    trained = [part for part, flag in (("tower", "train_vision_tower"), ("projector", "train_projector"))
               if inputs.get(flag)]
    how = f"the {' and '.join(trained)} trained" if trained else "frozen"
    images = ("one image a row at its most tiles" if vision.patches_per_row
              else "every position an image token, the worst --max-length allows")
    return (f"the vision tower and projector ({how}) add {size(added)} of it, the tower's activations on up to "
            f"{vision.patches(batch_size, max_length):,} patches a micro-batch ({images})")


def vision_flags(inputs: dict) -> str:
    """plan.py's flags for what this run trains of a vision-language model ('' for none)."""
    return "".join(f" --{flag.replace('_', '-')}" for flag in ("train_vision_tower", "train_projector")
                   if inputs.get(flag))


def vision_language_model(args) -> bool:
    """Whether the run's model reads images (its config names a vision part)."""
    config = model_config_object(args.model, getattr(args, "trust_remote_code", False))
    return config is not None and vision_language(config)


def host_load(shape, recipe: str, launch, precision: str, vision: planner.VisionShape | None = None) -> dict:
    """The planner's host RAM at load for this launch, on this machine (LOCAL_WORLD_SIZE processes), a
    vision-language model's tower and projector (`vision`) with the rest."""
    on_this_machine = int(os.environ.get("LOCAL_WORLD_SIZE", launch.processes))
    return planner.load_bytes_per_machine(
        shape, recipe, launch.planner_strategy, launch.gpus, gpus_per_machine=on_this_machine, precision=precision,
        every_process_reads=launch.every_process_reads, fsdp_reads_shards=launch.reads_shards,
        on_gpu=launch.on_gpu, vision=vision)


def machine_ram_bytes() -> int | None:
    """This machine's RAM as this process may use it: the physical memory, or a container's (cgroup)
    limit when lower; None where neither can be read."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits) if limits else None


def check_host_ram(load: dict, machine_bytes: int | None, model: str) -> None:
    """Refuse a launch whose weights alone outgrow this machine's RAM while they load (libraries and
    the data come on top, so a launch this lets through may still be short)."""
    if machine_bytes is None or load["bytes"] <= machine_bytes:
        return
    if load["copies"] > 1:
        fix = f"{load['one_copy'] + ', ' if load['one_copy'] else ''}fewer processes per machine, or a machine with more RAM"
    else:
        fix = "use a machine with more RAM, or a smaller model"
    refuse(f"--model {model}: loading its weights needs {size(load['bytes'])} of host RAM on this machine "
           f"({load['copies']} cop{'y' if load['copies'] == 1 else 'ies'}: {load['why']}), which has "
           f"{size(machine_bytes)}; {fix}")


def size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"
