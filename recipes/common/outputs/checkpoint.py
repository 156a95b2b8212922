"""Checkpoints that survive a crash, resume, and the final export that reloads anywhere.

A checkpoint is written aside (`.step-N.partial`) and renamed into place only when every rank
has finished writing, so a crash mid-save leaves the previous checkpoint as the newest one. Its
state file, written last, lists every file with its size and SHA-256: a file damaged later (a full
disk, a bad copy) is found before resuming, and `--resume auto` takes the newest intact checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..launching.args import SAVE_DTYPES
from ..launching.batch_size import rows_per_step
from ..launching.launch_config import launched_by_accelerate, launcher_argv
from ..data.images import model_inputs
from ..model import adapters, processors
from . import reshard
from ..refusal import refuse

STATE_FILE = "recipe_state.json"
# What `accelerate launch` puts in the environment; the merge process must not inherit it.
LAUNCH_ENV_PREFIXES = ("ACCELERATE_", "FSDP_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                       "MASTER_", "GROUP_RANK", "ROLE_", "TORCHELASTIC_", "PARALLELISM_CONFIG_")


def checkpoints_dir(output_dir) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir) -> list[Path]:
    """Finished checkpoints, oldest first (a partial one has no state file and no final name)."""
    folder = checkpoints_dir(output_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("step-*") if (p / STATE_FILE).is_file() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def file_digests(folder: Path) -> dict:
    """{relative path: {bytes, sha256}} of every file in a checkpoint folder but the state file."""
    digests = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != STATE_FILE):
        with open(path, "rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        digests[str(path.relative_to(folder))] = {"bytes": path.stat().st_size, "sha256": digest}
    return digests


def save_checkpoint(accelerator, args, launch, step: int, stages, kept: dict | None = None) -> Path:
    """checkpoints/step-N: the trained state, written by every rank, then its digests and state file (last: a
    checkpoint without one is incomplete). `kept`: {file name: JSON-able} the recipe keeps beside it (the main
    process writes them; `read_kept` gives them back)."""
    started = time.monotonic()
    final = checkpoints_dir(args.output_dir) / f"step-{step}"
    partial = final.with_name(f".step-{step}.partial")
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    with split_weights_apart(accelerator, partial, saving=True), stages_apart(stages, accelerator, partial):
        accelerator.save_state(str(partial))  # model, optimizer, scheduler, RNG: every rank writes its part
    if os.environ.get("RECIPES_TEST_KILL_DURING_SAVE") == str(step):  # fault-injection hook for the tests
        os.kill(os.getpid(), signal.SIGKILL)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for name, value in (kept or {}).items():
            (partial / name).write_text(json.dumps(value))
        # the trained parameters' names in the optimizer's order: how accelerate's optimizer.bin is read by name
        models = accelerator._models
        trained = list(reshard.trained_names(accelerator.unwrap_model(models[0]))) if models else None
        state = {"step": step, "recipe": args.recipe, "model": args.model, "files": file_digests(partial),
                 "settings": {name: getattr(args, name) for name in KEPT_SETTINGS if hasattr(args, name)},
                 "processes": accelerator.num_processes, "global_batch": rows_per_step(args, launch),
                 "trained": trained, "save_seconds": round(time.monotonic() - started, 2)}
        (partial / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")  # last: the checkpoint is complete
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        if args.save_total_limit:  # keep the newest N
            for old in complete_checkpoints(args.output_dir)[:-args.save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


SPLIT_STATE = "split_model_and_optimizer"  # torch.distributed.checkpoint's files: every rank's part


@contextmanager
def split_weights_apart(accelerator, folder: Path, saving: bool):
    """Tensor parallel's split weights, written or read by every rank (torch's distributed checkpoint);
    accelerate's save_state / load_state do the rest (schedule, random states, data order) inside.

    accelerate leaves a tensor parallel model as transformers split it (a MULTI_GPU launch with
    DTensor weights) and would write only the main process's part of it and of the optimizer.
    Elsewhere this does nothing."""
    from torch.distributed.tensor import DTensor

    models, optimizers = accelerator._models, accelerator._optimizers  # what save_state / load_state walk
    split = accelerator.distributed_type.value == "MULTI_GPU" and any(
        isinstance(p, DTensor) for model in models for p in model.parameters())
    if not split:
        yield
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = models[0], optimizers[0].optimizer
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    if saving:
        dcp.save(state, checkpoint_id=str(folder / SPLIT_STATE))
    else:
        dcp.load(state, checkpoint_id=str(folder / SPLIT_STATE))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    accelerator._models, accelerator._optimizers = [], []
    try:
        yield
    finally:
        accelerator._models, accelerator._optimizers = models, optimizers


STAGES_STATE = "pipeline_stages"  # each stage's trained weights and optimizer state


@contextmanager
def stages_apart(stages, accelerator, folder: Path):
    """Pipeline parallel: each stage's trained weights and optimizer state, written by the first pipeline's
    ranks (the replicas hold the same); accelerate's save_state writes the rest inside (schedule, random
    states), as for one process. Read back by name (reshard.py). Elsewhere (`stages` None) nothing."""
    if stages is None:
        yield
        return
    optimizers = accelerator._optimizers
    if stages.layout.replica == 0:
        file = folder / STAGES_STATE / f"stage-{stages.layout.stage}.pt"
        file.parent.mkdir(exist_ok=True)
        trained = {name: p.detach().cpu() for name, p in stages.module.model.named_parameters() if p.requires_grad}
        torch.save({"model": trained, "optimizer": optimizers[0].optimizer.state_dict()}, file)
    accelerator._optimizers = []  # accelerate would write the main process's stage only
    try:
        yield
    finally:
        accelerator._optimizers = optimizers


def damage(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted, or None when every file is as it was written."""
    try:
        state = json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return f"no readable {STATE_FILE} (the save did not finish)"
    for name, written in state.get("files", {}).items():  # checkpoints from before the manifest list none
        file = Path(path) / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != written["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, {written['bytes']} were written"
        with open(file, "rb") as handle:
            if hashlib.file_digest(handle, "sha256").hexdigest() != written["sha256"]:
                return f"{name} has changed since it was written"
    return None


# Flags a resumed run cannot change: the adapter's shape (the checkpoint would not load), and what the optimizer
# and scheduler states restore over the flag (a new value would be ignored without a word).
KEPT_SETTINGS = ("lora_r", "lora_alpha", "lora_targets", "use_dora", "use_rslora", "bits", "lr", "warmup_ratio",
                 "weight_decay", "train_vision_tower", "train_projector")


def same_model(a: str, b: str) -> bool:
    return a == b or (Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve())


def written_as(path: Path) -> tuple[str, int | None]:
    """The layout a checkpoint's files were written in, read from the files themselves (any checkpoint, of any
    version), and for DeepSpeed's the processes that wrote it: "zero" (ZeRO-1/2), "zero3", "fsdp" (sharded),
    "fsdp_full" (FSDP with FULL_STATE_DICT), "split" (tensor parallel's), "pipeline", or "whole": one process's
    files (one process, DDP, model parallel)."""
    folder = path / "pytorch_model"
    if folder.is_dir():  # DeepSpeed's engine: one file of optimizer state per process
        stage = "zero3" if any(folder.glob("zero_pp_rank_*_model_states.pt")) else "zero"
        return stage, len(list(folder.glob("*_optim_states.pt"))) or None
    if any(path.glob("pytorch_model_fsdp_*")):
        return "fsdp", None
    if (path / "pytorch_model_fsdp.bin").is_file():  # fsdp_state_dict_type FULL_STATE_DICT: gathered, whole files
        return "fsdp_full", None
    if (path / SPLIT_STATE).is_dir():
        return "split", None
    if (path / STAGES_STATE).is_dir():
        return "pipeline", None
    return "whole", None


def launch_layout(distributed_type: str, launch) -> str:
    """The layout this launch writes its checkpoints in (the names of `written_as`)."""
    if distributed_type == "DEEPSPEED":
        return "zero3" if launch.zero_stage == 3 else "zero"
    if distributed_type == "FSDP":
        return "fsdp_full" if launch.full_state_dict else "fsdp"
    if launch.pipeline_stages > 1:
        return "pipeline"
    return "split" if launch.tensor_parallel > 1 else "whole"


# What writes each layout, as a note names it
# what a checkpoint's layout holds, as its resume line says it (the processes that wrote it are said apart)
WRITTEN_BY = {"zero": "DeepSpeed ZeRO-1/2's partitions", "zero3": "DeepSpeed ZeRO-3's partitions",
              "fsdp": "FSDP's shards", "fsdp_full": "FSDP's whole state dict", "split": "tensor parallel's splits",
              "whole": "whole weights (as one process, DDP and model parallel write them)",
              "pipeline": "pipeline parallel's stages"}


def read_by_name(written: str, count: int | None, layout: str, processes: int) -> bool:
    """Whether a checkpoint written in layout `written` (by `count` processes: `written_as`) is read parameter by
    parameter (reshard.py) rather than by the strategy that wrote it: another layout, DeepSpeed's partitions over
    another number of processes, or a pipeline's stages (each stage takes its layers' names from all of them: any
    cut of the layers reads them)."""
    return written != layout or written == "pipeline" or (written in ("zero", "zero3") and count != processes)


def choose_resume(args, processes: int | None = None,
                  global_batch: int | None = None) -> tuple[Path | None, list[str], str | None]:
    """(checkpoint to resume from, lines to print, refusal): the decision of `resume_point` for a run of
    `processes` processes taking `global_batch` rows a step."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    wanted = args.resume or ("auto" if restarted else None)  # an elastic restart continues the run
    found = complete_checkpoints(args.output_dir)
    if not wanted:
        if found:
            return None, [], (f"{args.output_dir} already holds checkpoints of another run; pass --resume auto to "
                              "continue it, or choose a new --output-dir")
        return None, [], None
    lines = [f"restart {restarted} ({restarting_launcher()}): continuing from the newest intact checkpoint"
             ] if restarted else []
    if wanted == "auto":
        chosen = None
        for path in reversed(found):
            why = damage(path)
            if why is None:
                chosen = path
                break
            lines.append(f"skipping damaged checkpoint {path}: {why}")
        if found and chosen is None:
            return None, lines, (f"no intact checkpoint in {checkpoints_dir(args.output_dir)}; delete the damaged "
                                 "ones to start afresh, or choose a new --output-dir")
    else:
        chosen = Path(wanted)
        if not chosen.is_dir():
            return None, lines, (f"--resume {chosen} does not exist; give a checkpoint folder "
                                 f"(<output-dir>/checkpoints/step-N) or `auto`")
        if (chosen / "checkpoints").is_dir() or (chosen / "run.json").is_file():
            return None, lines, (f"--resume {chosen} is a run's folder, not a checkpoint; continue that run with "
                                 f"--output-dir {chosen} --resume auto, or give one of {chosen}/checkpoints/step-N")
        why = damage(chosen)
        if why is not None:
            return None, lines, (f"--resume {chosen} cannot be used: {why}; use --resume auto to take the newest "
                                 f"intact checkpoint in {checkpoints_dir(args.output_dir)}")
    if chosen is not None:
        state = json.loads((chosen / STATE_FILE).read_text())
        if state.get("recipe", args.recipe) != args.recipe or not same_model(state.get("model", args.model), args.model):
            return None, lines, (f"{chosen} was written by {state['recipe']}.py training {state['model']}; this run "
                                 f"is {args.recipe}.py training {args.model}: pass that --model, or choose a new "
                                 "--output-dir")
        changed = {name: value for name, value in state.get("settings", {}).items()
                   if hasattr(args, name) and getattr(args, name) != value}
        if changed:
            was = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in changed.items())
            return None, lines, (f"{chosen} was trained with {was}, which a resumed run keeps; pass the same, or "
                                 "start in a new --output-dir to change them")
        if args.max_steps and state["step"] > args.max_steps:
            return None, lines, (f"{chosen} is at step {state['step']}, beyond --max-steps {args.max_steps}; raise "
                                 "--max-steps to train on, or use that run's own result")
        written_by, was = state.get("processes", processes), state.get("global_batch", global_batch)
        if global_batch is not None and was is not None and was != global_batch:  # allowed, and said
            lines.append(f"note: {chosen} trained on {was} rows a step and this launch takes {global_batch}: the "
                         f"steps from here take other rows, so the curve changes; --global-batch-size {was} keeps it")
        elif processes is not None and written_by != processes:
            lines.append(f"note: {chosen} was written by {written_by} processes and resumes on {processes} with the "
                         "same global batch: each step takes the rows it took before")
    return chosen, lines, None


def restarting_launcher(argv: list[str] | None = None) -> str:
    """What restarted this process, as the user typed it: accelerate's launcher or torchrun."""
    argv = launcher_argv() if argv is None else argv
    return "accelerate launch --max_restarts" if launched_by_accelerate(argv) else "torchrun --max-restarts"


@dataclass(frozen=True)
class Resume:
    path: Path  # the checkpoint
    written: str  # the layout it was written in (`written_as`)
    by_name: bool  # read parameter by parameter into this launch's layout (`read_by_name`)


def resume_point(accelerator, args, launch) -> Resume | None:
    """The checkpoint this run continues from (None: a fresh start), chosen and checked before the
    model loads. The main process reads and hashes the files once; every rank gets its verdict,
    so a refusal is the same line on every rank."""
    from accelerate.utils import broadcast_object_list

    layout = launch_layout(accelerator.distributed_type.value, launch)
    decision = [None]
    if accelerator.is_main_process:
        chosen, lines, refusal = choose_resume(args, accelerator.num_processes, rows_per_step(args, launch))
        resume = None
        if chosen is not None:
            found, count = written_as(chosen)
            resume = Resume(chosen, found, read_by_name(found, count, layout, accelerator.num_processes))
            if resume.by_name:
                lines.append(f"note: {chosen} holds {WRITTEN_BY[found]}"
                             f"{f' of {count} processes' if count else ''}: its trained state is read parameter by "
                             "parameter into this launch")
        decision = [(resume, lines, refusal)]
    if accelerator.num_processes > 1:
        broadcast_object_list(decision)
    resume, lines, refusal = decision[0]
    if accelerator.is_main_process:
        for line in lines:
            print(line, flush=True)
    if refusal:
        refuse(refusal)
    return resume


def resume_from(accelerator, resume: Resume | None, model, optimizer, stages) -> int:
    """Restore the checkpoint `resume_point` chose and return its step (0 when starting fresh)."""
    if resume is None:
        return 0
    path, started = Path(resume.path), time.monotonic()
    state = json.loads((path / STATE_FILE).read_text())
    if resume.by_name:
        with trained_state_apart(accelerator, path):
            accelerator.load_state(str(path))
        trained = accelerator.unwrap_model(model)
        names = state.get("trained") or list(reshard.trained_names(trained))  # (checkpoints before names were kept)
        with reshard.open_written(path, resume.written, names, accelerator.is_main_process,
                                  accelerator.wait_for_everyone) as (read, moments_step):
            reshard.load_trained_state(trained, optimizer, read, moments_step)
        for index, scheduler in enumerate(accelerator._schedulers):  # accelerate's file names
            file = path / ("scheduler.bin" if index == 0 else f"scheduler_{index}.bin")
            reshard.load_schedule(getattr(scheduler, "scheduler", scheduler), torch.load(file, weights_only=True))
    else:
        with split_weights_apart(accelerator, path, saving=False):
            accelerator.load_state(str(path))
    step = state["step"]
    # load_state restored accelerate's micro-batch counter as the writing launch left it (its steps x its
    # accumulation, and on its ranks only: a rank it did not have keeps 0). The counter decides which
    # micro-batch syncs and steps the optimizer (DeepSpeed's engine too), so it is set as this launch
    # would have it after `step` steps.
    accelerator.step = step * accelerator.gradient_state.num_steps
    if accelerator.is_main_process:
        how = "by parameter name" if resume.by_name else "as written"
        print(f"resumed from {path} at step {step} (read {how} in {time.monotonic() - started:.1f} s)", flush=True)
    return step


def read_kept(resume: Resume | None, name: str):
    """What the checkpoint being continued keeps as `name` (save_checkpoint's `kept`), or None."""
    path = Path(resume.path) / name if resume is not None else None
    return json.loads(path.read_text()) if path is not None and path.exists() else None


@contextmanager
def trained_state_apart(accelerator, path: Path):
    """accelerate's load_state (random states, data order, fp16's loss scale where the checkpoint has one) without
    the models, optimizers and schedules: their state comes by name."""
    kept = accelerator._models, accelerator._optimizers, accelerator._schedulers, accelerator.scaler
    scaler = accelerator.scaler if (path / "scaler.pt").is_file() else None  # accelerate's file for it
    accelerator._models, accelerator._optimizers, accelerator._schedulers, accelerator.scaler = [], [], [], scaler
    try:
        yield
    finally:
        accelerator._models, accelerator._optimizers, accelerator._schedulers, accelerator.scaler = kept


def save_full_model(accelerator, model, stages, tokenizer, path: Path, dtype: str = "auto") -> None:
    """`model/`: loadable by `AutoModelForCausalLM.from_pretrained`, whatever the strategy; its floating
    weights in `dtype` (a --save-dtype name; auto: as trained).

    `get_state_dict` gathers FSDP shards and ZeRO-3 partitions on every rank (a collective),
    then only the main process writes. Tensor parallel's split weights are left to transformers by
    accelerate: every rank gathers them here, and every rank calls `save_pretrained`, which then
    waits for the writer (a transformers model split at load saves collectively).
    """
    from torch.distributed.tensor import DTensor

    if stages:  # each stage holds its layers: rank 0 gathers them
        state_dict = stages.gathered_state_dict(model)
    else:
        state_dict = accelerator.get_state_dict(model)  # ZeRO-3: None on all but the main process
    split = state_dict is not None and any(isinstance(tensor, DTensor) for tensor in state_dict.values())
    if split:  # the same keys in the same order on every rank: each full_tensor() is a collective
        state_dict = {key: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                      for key, tensor in state_dict.items()}
    if dtype != "auto" and state_dict is not None:
        wanted = getattr(torch, SAVE_DTYPES[dtype])
        state_dict = {key: tensor.to(wanted) if tensor.is_floating_point() else tensor
                      for key, tensor in state_dict.items()}
    adapter_of_stages = stages is not None and hasattr(model, "peft_config")
    if accelerator.is_main_process or split:
        accelerator.unwrap_model(model).save_pretrained(
            path, state_dict=None if adapter_of_stages else state_dict, safe_serialization=True,
            is_main_process=accelerator.is_main_process)
    if adapter_of_stages and accelerator.is_main_process:  # rank 0 wrote its stage's adapter: now every stage's
        from safetensors.torch import save_file

        save_file(state_dict, str(Path(path) / "adapter_model.safetensors"), metadata={"format": "pt"})
        name_every_adapted_layer(Path(path) / "adapter_config.json", state_dict)
    if accelerator.is_main_process and dtype != "auto":
        # config.json says what the files hold (from_pretrained's dtype="auto"); transformers wrote the
        # dtype of the model in memory there
        config_file = Path(path) / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "dtype": SAVE_DTYPES[dtype]}, indent=2))
    if accelerator.is_main_process:
        processors.save(tokenizer, path)  # (a vision-language model's processor, where the recipe passes one)
    accelerator.wait_for_everyone()


def name_every_adapted_layer(config_file: Path, adapter: dict) -> None:
    """adapter_config.json's target_modules: every layer `adapter` holds tensors of, by its full name. peft
    wrote those of the stage it was called on, which held some of the layers (and, where it resolved
    `all-linear` over few layers, named them one by one): loaded as written, the other stages' tensors
    would be left out."""
    import re

    modules = {match.group(1) for key in adapter
               if (match := re.match(r"base_model\.model\.(.+?)\.lora_(?:embedding_)?[AB]\b", key))}
    config = json.loads(config_file.read_text())
    config["target_modules"] = sorted(modules)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_adapter(accelerator, model, stages, tokenizer, path: Path, moved: bool = True) -> None:
    """`adapter/`: loadable by `PeftModel.from_pretrained`, checked tensor by tensor (`moved` False: a run whose
    updates were all zero, as an online run's whose completions all tied on reward, may save a zero adapter).

    peft's `save_pretrained` keeps only the adapter's tensors of the gathered state dict. Trained on an adapter
    merged into its base (an adapter as --model), it is then made to stand alone, without the merged copy in
    the cache (model/adapters.py: `stand_alone`).
    """
    save_full_model(accelerator, model, stages, tokenizer, path)
    if accelerator.is_main_process:
        check_adapter(path, moved)
        how = adapters.stand_alone(Path(path))
        if how:
            print(how, flush=True)


def check_adapter(path: Path, moved: bool = True) -> None:
    """Refuse to call a run successful when the saved adapter is empty or untrained."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
    lora = {name: t for name, t in tensors.items() if "lora_" in name}
    if not lora:
        raise RuntimeError(f"{path}: the adapter holds no LoRA tensors")
    for name, tensor in lora.items():  # matrices, and DoRA's magnitude vectors
        if tensor.dim() != (1 if "lora_magnitude_vector" in name else 2) or tensor.numel() == 0:
            raise RuntimeError(f"{path}: {name} has shape {tuple(tensor.shape)}; a sharded save lost it")
    if moved and all(torch.count_nonzero(t) == 0 for name, t in lora.items() if "lora_B" in name):
        raise RuntimeError(f"{path}: every lora_B is zero; the adapter was never trained or was saved empty")


def merge_adapter(accelerator, base_model: str, adapter, merged, base_4bit: bool = False, dtype: str = "auto",
                  reward: bool = False) -> None:
    """`merged/`: the adapter merged into the base weights, as a plain transformers model, in `dtype` (a
    --save-dtype name; auto: the base's).

    Done by the main process in a fresh Python (merge.py): a process outside the training's
    process group loads the base without any FSDP or ZeRO-3 collective, so nothing can hang. Where the run
    trained on a merged adapter (`base_model` a merged start), the exported adapter names its own base
    (save_adapter made it stand alone), and that is the base it merges onto. `reward`: a reward model's adapter
    (its score head trained too), merged into the family's AutoModelForSequenceClassification.
    """
    if accelerator.is_main_process:
        if adapters.merged_start(str(base_model)):
            base_model = adapters.adapter_base(str(adapter))
        command = [sys.executable, str(Path(__file__).with_name("merge.py")),
                   "--base", str(base_model), "--adapter", str(adapter), "--output", str(merged)]
        clean_env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_ENV_PREFIXES)}
        subprocess.run(command + (["--base-4bit"] if base_4bit else []) + (["--reward"] if reward else [])
                       + ["--dtype", dtype], check=True, env=clean_env)
    accelerator.wait_for_everyone()


@torch.no_grad()
def probe_logits(model, batch: dict) -> torch.Tensor:
    """Logits of the trained model on a fixed batch, to compare with the saved model reloaded."""
    model.eval()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   **model_inputs(batch)).logits.float().cpu()  # (image rows: their pixels)
    model.train()
    return logits


def save_probe(accelerator, model, stages, batch: dict, output_dir) -> None:
    """Logits of the trained model on a fixed batch, so a reload can be compared with it."""
    from safetensors.torch import save_file

    batch = {key: value.to(accelerator.device) for key, value in batch.items()}
    if stages:  # the last stage of the first pipeline has the logits: it writes them
        logits = stages.forward_only(batch)
        writer = logits is not None and stages.layout.replica == 0
        logits = logits.float().cpu() if writer else None
    else:
        logits, writer = probe_logits(model, batch), accelerator.is_main_process
    if writer:
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], **model_inputs(batch)}
        save_file({**{key: value.cpu().contiguous() for key, value in inputs.items()}, "logits": logits},
                  str(Path(output_dir) / "probe_logits.safetensors"))  # (image rows: their pixel inputs too)
    accelerator.wait_for_everyone()
