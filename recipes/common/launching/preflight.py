"""Checks that refuse a launch that cannot work, before any model is loaded.

Each refusal is one line naming the problem and the fix, printed once, and the process exits
with status 2. Every rank reaches the same verdict because every check reads only the launch
environment and the run, which are the same on every rank. A check reads and refuses (some return
what they found); settle.settle_launch orders them between the steps that settle the run.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import planner

from ..data.data_files import looks_local
from ..data.mixture import data_specs
from ..model.model_config import (is_default_model, meta_model, model_config_object, module_kinds, quantizable_weights,
                                  vision_language)
from ..model.vision import tower_linears, vision_parts
from ..model.pipeline_layout import check_layout, unstageable
from ..model.score_head import why_not_a_reward_model
from ..refusal import Refusal, refuse  # noqa: F401  (preflight.refuse and preflight.Refusal, as the recipes and tests use them)
from ..rewards import BUNDLED_REWARD
from .args import VISION_FLAGS, VISION_RECIPES, lora_targets
from .launch import DDP, DEEPSPEED, FSDP, MODEL_PARALLEL, SINGLE, TENSOR_PARALLEL
from .launch import flag as env_flag  # (`flag` names the flags in the checks below)
from .memory_plan import size
from .versions import too_old


def check_versions() -> None:
    old = too_old()
    if old:
        refuse(f"too old for these recipes: {', '.join(old)}; pip install -r requirements.txt (the tested "
               "versions), or upgrade just these")


def hub_ids(args, model: str) -> dict[str, str]:
    """{flag: hub id} of what this run would ask the hub for: `model` (the model, or an adapter's base) and the
    data sources that are neither files nor folders here."""
    found = {}
    if not (looks_local(model) or Path(model).expanduser().exists() or is_default_model(model)):
        found["--model"] = model
    for flag, spec in data_specs(args):
        if spec and not looks_local(spec) and not Path(spec).expanduser().exists():
            found.setdefault(flag, spec)
    return found


def check_hub(args, model: str) -> None:
    """A run that reads the hub asks it once whether it answers (one request, no retries). When it does not,
    this process goes offline (huggingface_hub's and datasets' HF_HUB_OFFLINE), so every later read takes the
    cache at once instead of retrying each file for ~25 s, and a model the cache lacks is refused here, in one
    line. With HF_HUB_OFFLINE already set, only the cache is checked."""
    wanted = hub_ids(args, model)
    if not wanted:
        return
    from huggingface_hub import constants, is_offline_mode, try_to_load_from_cache

    reason = None if is_offline_mode() else hub_unanswered()
    if reason:
        go_offline()
    if is_offline_mode() and "--model" in wanted and not isinstance(try_to_load_from_cache(model, "config.json"), str):
        why = f"the hub ({constants.ENDPOINT}) did not answer: {reason}" if reason else "HF_HUB_OFFLINE is set"
        refuse(f"--model {model} is not in this machine's hub cache and {why}; download it where the hub can be "
               f"reached (`hf download {model}`, into HF_HOME), or give a local folder")
    if reason and int(os.environ.get("RANK", "0")) == 0:  # (a hub dataset's cache is datasets': data_files says)
        print(f"hub: {constants.ENDPOINT} did not answer ({reason}); reading {', '.join(wanted.values())} from this "
              "machine's cache only, as HF_HUB_OFFLINE=1 would", flush=True)


def hub_unanswered() -> str | None:
    """Why the hub did not answer one request (no retries), in a few words; None when it answered (any HTTP
    status: an answer is all this asks)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as error:  # no answer at all: name resolution, refused, timed out, a proxy, TLS
        text = str(error).strip()
        return text.splitlines()[0] if text else type(error).__name__
    return None


def go_offline() -> None:
    """HF_HUB_OFFLINE=1 for the rest of this process and those it starts: huggingface_hub (and transformers
    through it) and datasets read the variable when they are imported, so their copies are set too."""
    import datasets.config
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True


def check_inputs(args) -> None:
    """The model's folder holds a model (quick_checks.check_paths: the paths exist), and the model can take
    --max-length tokens."""
    check_model_folder(args.model)
    context = context_length(args.model)
    if context and args.max_length > context:
        refuse(f"--max-length {args.max_length} is beyond the model's context of {context} tokens; "
               f"pass --max-length {context} or less")


def check_outputs(args, recipe: str) -> None:
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    check_output_dir(args.output_dir, resuming=bool(args.resume) or restarted)
    refuse_if_disk_too_small(args, recipe)


def check_pipeline(args, recipe: str, launch):
    """--pipeline-stages N: what a pipeline cannot run yet, refused before loading; the launch with its stages."""
    stages = args.pipeline_stages
    if stages == 1:
        return launch
    from dataclasses import replace

    if launch.kind != DDP:
        refuse("--pipeline-stages runs on a plain multi-process launch (accelerate_configs/pipeline.yaml), not on "
               f"{launch.name}; FSDP, DeepSpeed or tensor parallel within a stage are not built")
    built = meta_model(args.model, args.trust_remote_code)  # None: a hub model not in the cache
    problem = unstageable(built) if built is not None else None
    if problem:
        refuse(f"pipeline parallel cannot cut {args.model} into stages: {problem}; use accelerate_configs/fsdp.yaml")
    config_dict = model_config(args.model) or {}
    layers = config_dict.get("num_hidden_layers") or (config_dict.get("text_config") or {}).get("num_hidden_layers")
    chunks = args.pipeline_chunks if args.pipeline_schedule == "interleaved" else 1
    check_layout(stages, launch.processes, layers, chunks)
    if args.liger:
        refuse("--liger's kernels are not patched into pipeline stages; drop --liger with --pipeline-stages")
    if recipe == "full" and config_dict.get("tie_word_embeddings"):
        refuse(f"{args.model} ties its LM head to its embedding, which pipeline stages would hold apart on the "
               "first and last stage; train it with recipes/lora.py, or with fsdp.yaml")
    if config_dict.get("output_router_logits"):
        refuse("a mixture of experts' router loss is not carried through pipeline stages; set "
               "output_router_logits false in the model's config, or use fsdp.yaml")
    return replace(launch, pipeline_stages=stages, pipeline_chunks=chunks)


def check_pipeline_micro_batches(args, launch) -> None:
    """torch's 1F1B needs a micro-batch for every stage to be in flight, its interleaved 1F1B rounds of one
    micro-batch per stage; GPipe runs fewer (idling more)."""
    stages = launch.pipeline_stages
    if stages > 1 and args.pipeline_schedule == "interleaved" and args.grad_accum % stages:
        fits = max(stages, args.grad_accum // stages * stages)
        refuse(f"the interleaved schedule runs rounds of one micro-batch per stage: --grad-accum {fits} (a multiple "
               f"of the {stages} stages, not {args.grad_accum}), or --pipeline-schedule gpipe")
    if stages > 1 and args.pipeline_schedule == "1f1b" and args.grad_accum < stages:
        refuse(f"1F1B needs at least as many micro-batches per step as stages: --grad-accum {stages} or more (with "
               f"{2 * stages} each stage idles {(stages - 1) / (3 * stages - 1):.0%} of a step), or "
               "--pipeline-schedule gpipe")


# the strategies a vision-language model has run under (the others refuse it, naming these)
VISION_STRATEGIES = (SINGLE, MODEL_PARALLEL, DDP, FSDP, DEEPSPEED)


def check_vision_language(args, launch) -> None:
    """A vision-language model trains with the supervised recipes under the strategies listed above; anything
    else is refused before it loads, naming what runs it. --train-vision-tower / --train-projector need a model with
    those parts."""
    config = model_config_object(args.model, args.trust_remote_code)
    asked = [f"--{flag.replace('_', '-')}" for flag in VISION_FLAGS if getattr(args, flag, False)]
    if asked and config is not None and not vision_language(config):
        refuse(f"{' and '.join(asked)}: --model {args.model} reads text only (its config names no vision part); "
               f"drop {'them' if len(asked) > 1 else 'it'}, or give an image-text-to-text model")
    if config is None or not vision_language(config):
        return
    if config.model_type == "paligemma" and args.recipe in ("dpo", "dpo_full"):
        refuse(f"--model {args.model} is PaliGemma, whose preference pairs {args.recipe}.py does not train yet (its "
               "prefix-LM layout is trained by recipes/lora.py, qlora.py and full.py); fine-tune Gemma 3 with "
               f"{args.recipe}.py, or SFT PaliGemma (docs/data.md#images)")
    if args.recipe not in VISION_RECIPES + ("dpo", "dpo_full"):
        refuse(f"--model {args.model} is a vision-language model, which {args.recipe}.py does not train yet; "
               "recipes/lora.py, qlora.py, full.py, dpo.py and dpo_full.py do (docs/data.md#images)")
    if args.recipe in ("dpo", "dpo_full") and args.loss == "orpo":
        refuse(f"--loss orpo with a vision-language model ({args.model}) is not trained yet (its SFT term would score "
               "the image tokens); use --loss sigmoid, ipo or simpo, or SFT first with recipes/lora.py")
    if getattr(args, "eval_tasks", None):
        refuse(f"--eval-tasks scores lm-eval's text tasks, which a vision-language model ({args.model}) does not run "
               "here yet; leave --eval-tasks out (the run's own evaluation on held-out image rows still runs)")
    if launch.kind not in VISION_STRATEGIES or launch.pipeline_stages > 1 or launch.sequence_parallel > 1:
        refuse(f"--model {args.model} is a vision-language model, which {launch.name} does not run "
               "yet; use accelerate_configs/ddp.yaml, fsdp.yaml or zero3.yaml (docs/data.md#images)")
    if asked:
        check_vision_parts(args, asked)


def check_vision_parts(args, asked: list[str]) -> None:
    """The parts the flags train exist in the model (found as modeling.vision_parts finds them, on the model built
    from its config: no weights), and under LoRA --lora-targets names some linear layer of the vision tower."""
    model = meta_model(args.model, args.trust_remote_code)
    if model is None:  # a hub model not in the cache: found again when it loads
        return
    parts = vision_parts(model)
    if parts is None:
        refuse(f"{' and '.join(asked)}: transformers finds no vision tower in {args.model} "
               f"({type(model).__name__}.get_encoder(modality='image')); drop {'them' if len(asked) > 1 else 'it'}")
    tower, projector = parts
    if args.train_projector and not projector:
        refuse(f"--train-projector: {args.model} has no projector beside its vision tower {tower} and its language "
               "model; drop --train-projector (--train-vision-tower trains the tower)")
    if args.train_vision_tower and args.recipe != "full" and not tower_linears(model, lora_targets(args.lora_targets)):
        leaves = sorted({name.rsplit(".", 1)[-1] for name in tower_linears(model, "all-linear")})
        refuse(f"--train-vision-tower: --lora-targets {args.lora_targets} names no linear layer of {args.model}'s "
               f"vision tower, whose linear layers are {', '.join(leaves)}; add some of them, or use all-linear")


def check_strategy(args, recipe: str, launch) -> None:
    """What the launched strategy cannot do with these flags and this model (scripts/check_config.py
    runs it too)."""

    fsdp = launch.kind == FSDP
    if recipe == "qlora" and getattr(args, "bits", 4) == 8 and fsdp:
        refuse("8-bit weights cannot be sharded by FSDP; use --bits 4 (QLoRA) with fsdp.yaml, or "
               "8-bit with accelerate_configs/ddp.yaml or zero3.yaml")
    if fsdp and env_flag(os.environ, "FSDP_ACTIVATION_CHECKPOINTING") and args.gradient_checkpointing:
        refuse("activation checkpointing is asked twice (fsdp_activation_checkpointing in the "
               "accelerate config and --gradient-checkpointing); keep one of them")
    if getattr(args, "use_dora", False) and getattr(args, "bits", None) and launch.zero_stage == 3:
        refuse("--use-dora with --bits cannot run under ZeRO-3: peft's DoRA reads each 4-bit weight whole, which "
               "DeepSpeed keeps partitioned; use accelerate_configs/fsdp_offload.yaml or zero2.yaml")
    if fsdp:
        check_layer_classes_to_wrap(args.model)


def check_preference_run(args, launch) -> None:
    """What a preference recipe does not run: rows packed together (a pair's two sides are scored as
    whole rows), pipeline stages, Liger's fused loss (it returns a loss, not each row's log-probability)."""
    if args.packing:
        refuse("--packing joins rows into one sequence, but a preference pair is scored as two whole rows; "
               "drop --packing")
    if launch.pipeline_stages > 1:
        refuse(f"{args.recipe}.py does not run pipeline stages yet; launch with fsdp.yaml or a zero*.yaml config instead")
    if args.batch_size == "auto":
        refuse("--batch-size auto is planned for rows, and a preference pair is two rows in one forward; give --batch-size N")


def check_feedback_run(args, launch) -> None:
    """What KTO does not run yet: rows packed together (each reply and its mismatched row are scored as whole
    rows), pipeline stages, sequence parallel, --batch-size auto (each row brings its mismatched row)."""
    if args.packing:
        refuse("--packing joins rows into one sequence, but KTO scores each reply as a whole row; drop --packing")
    if launch.pipeline_stages > 1 or launch.sequence_parallel > 1:
        refuse(f"{args.recipe}.py does not run {'pipeline stages' if launch.pipeline_stages > 1 else 'sequence parallel'} "
               "yet; launch with fsdp.yaml or a zero*.yaml config instead")
    if args.batch_size == "auto":
        refuse("--batch-size auto is planned for rows, and KTO scores each row with a mismatched one; give --batch-size N")


def check_reward_run(args, launch) -> None:
    """What a reward model does not run: what pairs cannot (check_preference_run), tensor or sequence parallel and
    pipeline stages asked by flag (the score head is one output, read at one position), --eval-tasks (lm-eval's
    tasks score text a model writes; a reward model writes none); and a model family whose sequence classifier
    would not read like its causal model with a score head (its config read as from_pretrained reads it, a hub
    model's too: a family found wanting only at saving would have trained for nothing)."""
    check_preference_run(args, launch)
    split = ("pipeline stages" if args.pipeline_stages > 1 or launch.pipeline_stages > 1
             else "tensor parallel" if launch.kind == TENSOR_PARALLEL
             else "sequence parallel" if launch.sequence_parallel > 1 else None)
    if split:
        refuse(f"{args.recipe}.py does not run {split}; launch with fsdp.yaml or a zero*.yaml config instead")
    if args.eval_tasks:
        refuse("--eval-tasks scores the text a model writes, and a reward model writes none; drop --eval-tasks "
               "(its held-out pairs' accuracy is in metrics.jsonl)")
    config = model_config_object(args.model, args.trust_remote_code)
    why_not = why_not_a_reward_model(config.to_dict() if config is not None else None)
    if why_not:
        refuse(f"--model {args.model} cannot train as a reward model here: {why_not}")


def settle_online_run(args, launch):
    """grpo.py's defaults that depend on other flags, as (value, why) changes: the bundled prompts' reward when
    no --reward is given on the bundled data (your prompts without one: quick_checks.check_rewards refused them);
    --beta 0.05 under --loss rloo (RLOOConfig's), else 0 (GRPOConfig's) (grpo_full.py's reference above 0: the
    weights as loaded, one more copy of a process's share)."""
    changes = {}
    if not args.reward:
        changes["reward"] = ([BUNDLED_REWARD], "the bundled prompts' reward (no --dataset, no --reward)")
    if args.beta is None:
        changes["beta"] = (0.05 if args.loss == "rloo" else 0.0, f"TRL's default for --loss {args.loss}")
    return changes


def check_online_strategy(args, launch) -> None:
    """The strategies an online recipe cannot generate under, refused before their own checks run."""
    if args.pipeline_stages > 1 or launch.pipeline_stages > 1 or launch.kind == TENSOR_PARALLEL or \
            launch.sequence_parallel > 1:
        what = ("pipeline stages" if max(args.pipeline_stages, launch.pipeline_stages) > 1 else "tensor parallel"
                if launch.kind == TENSOR_PARALLEL else "sequence parallel")
        refuse(f"grpo.py does not run {what}: generation needs each process to hold whole layers; launch with "
               "accelerate_configs/fsdp.yaml or zero3.yaml (they shard the model and gather it once per batch of "
               "completions)")


def check_online_run(args, launch) -> None:
    """What grpo.py cannot run with these flags, and batches that cannot hold whole groups, refused before the
    model loads (after check_online_strategy, which settle_launch runs before the strategies' own checks)."""
    if args.packing:
        refuse("--packing joins rows into one sequence, but grpo.py samples and scores each completion on its own; "
               "drop --packing")
    if args.batch_size == "auto":
        refuse("--batch-size auto is planned for training rows, not for sampling completions; give --batch-size N")
    step = args.batch_size * args.grad_accum * launch.data_parallel_size
    if step % args.num_generations:
        fits = [n for n in range(2, step + 1) if step % n == 0]
        refuse(f"the global batch of {step} completions (--batch-size {args.batch_size} x --grad-accum "
               f"{args.grad_accum} x {launch.data_parallel_size} process(es)) does not hold whole groups of "
               f"--num-generations {args.num_generations}; use --num-generations "
               f"{' or '.join(map(str, fits[-3:])) or 'a divisor'}, or a global batch that is a multiple of "
               f"{args.num_generations} (--global-batch-size {args.num_generations * max(1, step // args.num_generations)})")
    if args.max_completion_length >= args.max_length:
        refuse(f"--max-completion-length {args.max_completion_length} leaves no room for a prompt under --max-length "
               f"{args.max_length}; raise --max-length (prompt + completion) or lower --max-completion-length")
    if args.loss == "rloo" and "scale_rewards" in args.given_flags:
        refuse("--scale-rewards is GRPO's; --loss rloo uses the leave-one-out baseline (--normalize-advantages "
               "scales it over the batch)")
    if args.loss != "rloo" and args.normalize_advantages:
        refuse("--normalize-advantages is RLOO's (--loss rloo); GRPO's losses scale with --scale-rewards")


def check_prompt_count(prompts: int, per_step: int, args) -> None:
    """A step takes `per_step` prompts: the training prompts must hold at least one step's."""
    if prompts < per_step:
        refuse(f"--dataset has {prompts} training prompts, fewer than the {per_step} one step samples from (the "
               f"global batch / --num-generations {args.num_generations}); lower --batch-size or --grad-accum, or "
               "give more prompts")


def check_tensor_parallel(args, recipe: str, launch) -> None:
    """What tensor parallel can split: the model's heads, and LoRA where peft splits the adapter too."""
    plain = "accelerate_configs/fsdp.yaml"
    if recipe == "qlora":
        refuse(f"4-bit and 8-bit weights cannot be split by tensor parallel; QLoRA shards with {plain} instead")
    if recipe == "lora" and launch.data_parallel_size > 1:
        refuse("LoRA cannot run FSDP x TP: transformers shards the base as it loads, before peft adds the adapter, "
               "so FSDP would not keep the adapter in step across the groups; use accelerate_configs/tp.yaml or "
               f"{plain}")
    if args.liger:
        refuse("--liger's fused kernels take whole weights, and tensor parallel splits them; drop --liger")
    if getattr(args, "use_dora", False):
        refuse("--use-dora cannot run under tensor parallel: peft's DoRA adds each split weight to whole adapter "
               f"tensors; drop --use-dora, or use {plain}")
    config = model_config(args.model)
    if config is None:  # a hub model not in the cache: transformers checks as it loads
        return
    from transformers import AutoConfig

    plan = getattr(AutoConfig.for_model(**config), "base_model_tp_plan", None)
    if not plan:
        refuse(f"{config.get('model_type', args.model)} models have no tensor parallel plan in transformers; "
               f"use {plain}")
    import math

    if recipe == "lora":
        check_lora_split(args, plan)
    tp = launch.tensor_parallel
    heads = [config[key] for key in ("num_attention_heads", "num_key_value_heads") if config.get(key)]
    shared = math.gcd(*heads) if heads else 0  # what both head counts split into
    if shared and shared % tp:
        fits = [n for n in range(2, shared + 1) if shared % n == 0]
        refuse(f"tensor parallel over {tp} processes splits the attention heads, but {args.model} has "
               f"{' query / '.join(map(str, heads))} key-value heads; set parallelism_config_tp_size to "
               f"{' or '.join(map(str, fits)) or '1 (this model cannot be split)'}")


def check_lora_split(args, plan: dict) -> None:
    """peft splits an adapter with its layer under tensor parallel, but (peft 0.21) only on the
    column-split layers: on a row-split one the first forward fails with a shape error, and lm_head
    (split by the model class's own plan, with its output gathered) fails the same way."""
    from importlib.metadata import version

    styles = {}
    for name, style in plan.items():
        styles.setdefault(name.rsplit(".", 1)[-1], set()).add(style)
    column = sorted(leaf for leaf, kinds in styles.items() if kinds == {"colwise"})
    targets = lora_targets(args.lora_targets)
    wanted = set(styles) if targets == "all-linear" else set(targets)
    outside = sorted(wanted - set(column))  # row-split, split another way, or not in the plan at all
    if outside:
        row = [leaf for leaf in outside if leaf in styles]
        what = f"the row-split layers {', '.join(row)}" if row == outside else ', '.join(outside)
        refuse(f"LoRA on {what} fails under tensor parallel (peft {version('peft')} splits an adapter only "
               f"with a column-split layer); pass --lora-targets {','.join(column)} (the column-split ones), or "
               "use accelerate_configs/fsdp.yaml")


# What a run writes at the top of its folder: in a folder that holds no run, they would be someone else's
# (checkpoints/ are checked by the resume, which knows them by their state files).
RUN_FILES = ("README.md", "metrics.jsonl", "samples.jsonl", "adapter", "model", "merged")


def check_output_dir(output_dir: str, resuming: bool = False) -> None:
    """The run must be able to write where it is told to, before hours of training, and must not
    overwrite files it did not write (a project's README.md)."""
    import tempfile

    folder = Path(output_dir).expanduser().resolve()
    if folder.exists() and not folder.is_dir():
        refuse(f"--output-dir {output_dir} is a file; choose a folder")
    if folder.is_dir() and not (folder / "run.json").is_file():
        theirs = [name for name in RUN_FILES if (folder / name).exists()]
        if theirs:
            refuse(f"--output-dir {output_dir} holds {', '.join(theirs)} but no run.json: a run would overwrite "
                   "them; choose a new or empty folder")
    elif folder.is_dir() and not resuming and int(os.environ.get("RANK", "0")) == 0:
        print(f"note: --output-dir {output_dir} holds an earlier run; this run replaces its files", flush=True)
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        refuse(f"--output-dir {output_dir} lies under the file {folder}; choose a folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        refuse(f"--output-dir {output_dir} cannot be written ({error.strerror} in {folder}); choose another folder")


def check_lora_targets(args) -> None:
    """Every name in --lora-targets must match a module of the model, read from its config (no weights)."""

    targets = lora_targets(args.lora_targets)
    if targets == "all-linear":
        return
    if not targets:
        refuse("--lora-targets is empty; name modules (e.g. q_proj,v_proj) or use all-linear")
    kinds = module_kinds(args.model, args.trust_remote_code)
    if kinds is None:  # a hub model not in the cache: peft checks when it loads
        return

    def matched(target: str, wanted=("linear", "adaptable", "other")) -> bool:
        return any((name == target or name.endswith("." + target)) and kind in wanted for name, kind in kinds.items())

    leaves = ", ".join(sorted({name.rsplit(".", 1)[-1] for name, kind in kinds.items() if kind == "linear"}))
    missing = [t for t in targets if not matched(t)]
    if missing:
        which = "matches no module" if len(missing) == 1 else "match no module"
        which += "" if len(missing) == len(targets) else " (the others do)"
        refuse(f"--lora-targets {', '.join(missing)} {which} of {args.model}; its linear layers are "
               f"{leaves} (or use all-linear)")
    other = [t for t in targets if not matched(t, ("linear", "adaptable"))]
    if other:
        refuse(f"--lora-targets {', '.join(other)} names modules LoRA cannot adapt (peft adapts linear, embedding "
               f"and convolution layers); the model's linear layers are {leaves} (or use all-linear)")


def adapter_dropout(args) -> float:
    """The --lora-dropout peft takes on this model. peft builds the adapter once on the model made from
    its config (meta device: no weights), so what peft would refuse is refused here, before loading, in
    one line. peft adapts a mixture of experts' fused expert weights (MixtralExperts) through its
    ParamWrapper, which takes no dropout: a --lora-dropout a --config file set is 0 there (settle_launch
    says so), a typed one is refused naming the fix."""
    import warnings

    from accelerate import init_empty_weights
    from peft import LoraConfig, get_peft_model

    def build(dropout: float) -> None:
        model = meta_model(args.model, args.trust_remote_code)
        if model is None:  # a hub model not in the cache: peft checks when it loads
            return
        config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=dropout,
                            target_modules=lora_targets(args.lora_targets), task_type="CAUSAL_LM")
        with init_empty_weights(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft's notes on this throw-away build; the real one prints its own
            get_peft_model(model, config)

    def peft_refusal(dropout: float) -> str | None:
        """peft's own message when it refuses these flags on this model; None when it builds (or when it
        cannot build on the meta device at all: the real build, after loading, decides then)."""
        try:
            build(dropout)
        except ValueError as error:
            return " ".join(str(error).split())
        except Exception:  # noqa: BLE001  (not a verdict on the flags: e.g. remote code that needs real weights)
            return None
        return None

    dropout = args.lora_dropout
    problem = peft_refusal(dropout)
    if problem and "lora_dropout" in problem and dropout:
        if "lora_dropout" in args.given_flags:
            refuse(f"--lora-dropout {dropout}: peft's LoRA on {args.model}'s fused expert weights takes no "
                   "dropout; pass --lora-dropout 0, or --lora-targets naming attention layers only (e.g. "
                   "q_proj,k_proj,v_proj,o_proj)")
        dropout = 0.0
        problem = peft_refusal(dropout)
    if problem:
        refuse(f"peft cannot put LoRA on {args.model} with --lora-targets {args.lora_targets}: {problem}; "
               "change --lora-targets")
    return dropout


def check_quantization(args) -> dict | None:
    """QLoRA quantizes the base, or is refused: a model none of whose layers bitsandbytes replaces would
    train as plain LoRA on a full-precision base under QLoRA's name. Layers it leaves in the float dtype
    beside quantized ones (a mixture of experts' fused weights) are said, with their share. Returns the
    share (run.json records it; None for a hub model not in the cache)."""

    share = quantizable_weights(args.model, args.trust_remote_code)
    if share is None:  # a hub model not in the cache: load_model checks what loaded
        return None
    kinds = ", ".join(share["left_kinds"])
    if not share["quantized"]:
        refuse(f"bitsandbytes would quantize none of {args.model}'s layers ({kinds}: transformers' {args.bits}-bit "
               "loading replaces only torch's nn.Linear), so qlora.py would train plain LoRA on a full-precision "
               "base; use recipes/lora.py")
    if share["left"] and int(os.environ.get("RANK", "0")) == 0:
        quantized = share["quantized"] / (share["quantized"] + share["left"])
        print(f"quantization: {args.bits}-bit on {quantized:.0%} of the base's layer weights; left in the float dtype: "
              f"{kinds} (bitsandbytes replaces only torch's nn.Linear)", flush=True)
    return share


def check_speed_options(args, on_gpu: bool) -> None:
    """Kernels that exist only for CUDA GPUs, or only once installed, are refused before loading."""
    from importlib.util import find_spec

    if args.liger and find_spec("liger_kernel") is None:
        refuse("--liger needs Liger's kernels: `pip install liger-kernel`, or drop --liger")
    if args.liger and not on_gpu:
        refuse("--liger runs Triton kernels, which need a CUDA GPU; drop --liger on this machine")
    if args.attention == "flash_attention_2" and find_spec("flash_attn") is None:
        refuse("--attention flash_attention_2 needs `pip install flash-attn`; or use --attention sdpa "
               "(the default, which picks a flash kernel itself where it can)")
    if args.attention == "flash_attention_2" and not on_gpu:
        refuse("--attention flash_attention_2 needs a CUDA GPU; use --attention sdpa on this machine")
    if args.attention == "flex_attention" and not on_gpu:
        refuse("--attention flex_attention has no backward on CPU (torch); use --attention sdpa on this machine")
    tracker_package = {"wandb": "wandb", "trackio": "trackio", "tensorboard": "tensorboard"}.get(args.report_to)
    if tracker_package and find_spec(tracker_package) is None:
        refuse(f"--report-to {args.report_to} needs `pip install {tracker_package}`; or use --report-to none")


def check_sequence_parallel(args, launch) -> None:
    """What sequence parallel can split: attention heads that divide among the ranks, rows without packing on sdpa,
    no router loss."""
    size = launch.sequence_parallel
    if args.packing and launch.sequence_attention == "sdpa":
        refuse("--packing under sequence parallel needs flash_attention_2: sdpa runs the gathered sequence without "
               "a mask, so packed rows would attend to each other; drop --packing, or on GPUs set "
               "parallelism_config_sp_attn_implementation: flash_attention_2")
    config = model_config(args.model)
    if config is None:  # a hub model not in the cache: DeepSpeed checks the heads after loading
        return
    config = {**config.get("text_config", {}), **config}
    heads, groups = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and heads % size:
        fits = [n for n in range(2, heads + 1) if planner.group_splits_heads(n, heads, groups or heads)]
        refuse(f"sequence parallel over {size} ranks splits the attention heads, but {args.model} has {heads}; set "
               f"parallelism_config_sp_size to {' or '.join(map(str, fits[:4])) or '1'}")
    if groups and not planner.group_splits_heads(size, heads or size, groups):  # (the query heads passed above)
        refuse(f"sequence parallel over {size} ranks splits the key-value heads, but {args.model} has {groups}, "
               f"neither a multiple nor a divisor of {size}; change parallelism_config_sp_size")
    if config.get("output_router_logits"):
        refuse("a mixture of experts' router loss over a slice of each sequence is not the sequence's; set "
               "output_router_logits false in the model's config, or use accelerate_configs/zero3.yaml")


def model_config(model: str) -> dict | None:
    """The model's config.json when it is local (the default model's before its first build)."""

    path = Path(model) / "config.json"
    if is_default_model(model) and not path.is_file():
        path = Path(__file__).resolve().parents[3] / "data" / "tiny-llama-config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def check_layer_classes_to_wrap(model: str) -> None:
    """accelerate shards the layer classes `fsdp_transformer_layer_cls_to_wrap` names, and stops only
    after the model loaded when the model has none of them (a file written for another model)."""
    import importlib

    names = [name.strip() for name in os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if name.strip()]
    config = model_config(model) or {}
    kind = str(config.get("model_type", "")).replace("-", "_")
    if not names or not kind:
        return
    try:
        module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    except ImportError:  # remote code or an unusual layout: accelerate will say it
        return
    import torch

    # the model's own layer classes, or torch's (nn.Embedding, nn.Linear) that every such model holds
    missing = [name for name in names if not hasattr(module, name) and not hasattr(torch.nn, name)]
    if missing:
        own = sorted({layer for arch in config.get("architectures", [])
                      for layer in getattr(getattr(module, arch, None), "_no_split_modules", None) or ()})
        hint = f"set it to {', '.join(own)}, or delete it" if own else "delete it"
        refuse(f"fsdp_transformer_layer_cls_to_wrap names {', '.join(missing)}, which this {kind} model does not have; "
               f"{hint} (accelerate then shards the model's own decoder layers)")


def context_length(model: str) -> int | None:
    """The longest sequence the model's positions reach, under whichever name its config uses."""
    config = model_config(model) or {}
    config = {**config.get("text_config", {}), **config}
    return next((config[key] for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length",
                                         "seq_length") if isinstance(config.get(key), int)), None)


# Encoder families whose *ForCausalLM / *LMHeadModel class exists in transformers but attends both ways
# unless the config says is_decoder: trained as a causal LM, every target would be in plain sight.
ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "electra", "ernie", "rembert",
                 "roberta-prelayernorm", "data2vec-text", "xmod", "megatron-bert", "bert-generation", "big_bird",
                 "qdqbert", "nezha", "roc_bert", "mobilebert", "distilbert", "albert", "deberta", "deberta-v2"}


def check_model_folder(model: str) -> None:
    """A local --model folder must hold what a causal LM loads from: config.json naming a decoder with a
    causal-LM class, and safetensors weights (the recipes never unpickle .bin files)."""

    if is_default_model(model) or not (looks_local(model) or Path(model).expanduser().is_dir()):
        return  # a hub id (a local folder of the same name would be loaded instead, and is checked)
    folder = Path(model).expanduser()
    if not folder.is_dir():
        refuse(f"--model {model} is a file; give the model's folder (config.json, tokenizer, *.safetensors)")
    config = model_config(str(folder))
    if config is None:
        refuse(f"--model {model} holds no config.json; give the folder a model was saved to (save_pretrained)")
    kind = str(config.get("model_type", ""))
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    remote = "AutoModelForCausalLM" in str(config.get("auto_map", {}))  # its own code (--trust-remote-code)
    readable = kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    if kind and not readable and not remote:
        what = ("not a causal language model (transformers has no causal-LM class for it)"
                if kind in CONFIG_MAPPING_NAMES else "a model type this transformers does not know")
        refuse(f"--model {model} is a {kind} model, {what}; these recipes fine-tune decoder-only causal LMs "
               "(Llama, Mistral, Qwen, Gemma, GPT-2, ...) and image-text-to-text models (Qwen2-VL, LLaVA, ...)")
    if kind in ENCODER_TYPES and not config.get("is_decoder"):
        refuse(f"--model {model} is a {kind} encoder: it attends both ways, so next-token training would see the "
               "answers; use a decoder-only model (or set is_decoder: true in its config.json)")
    weights = list(folder.glob("*.safetensors")) + list(folder.glob("*.safetensors.index.json"))
    if not weights:
        pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
        found = f" (it has {', '.join(pickled[:3])}: convert with `model.save_pretrained(folder)` after loading "\
                "it once with transformers, which writes safetensors)" if pickled else ""
        refuse(f"--model {model} holds no *.safetensors weights{found}; the recipes load weights only from "
               "safetensors files")


def refuse_if_disk_too_small(args, recipe: str) -> None:
    """A checkpoint (weights + optimizer state) or the final export must fit on the output disk."""

    try:
        shape = planner.ModelShape.from_config(model_config(args.model))
        trained = shape.parameters if recipe == "full" else planner.lora_parameters(shape, args.lora_r,
                                                                                     args.lora_targets)
    except Exception:  # not a local config, or a model or targets the planner cannot size
        return
    # fp32 weights and AdamW's two moments; an adapter export holds only the adapter.
    checkpoint = shape.parameters * 4 + trained * 8
    export = trained * 4 if recipe != "full" else shape.parameters * 4
    need = max(checkpoint if args.save_every else 0, export)
    folder = Path(args.output_dir).resolve()
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if free < need:
        refuse(f"{folder} has {size(free)} free but this run writes about {size(need)}; free some disk or "
               "choose another --output-dir")
