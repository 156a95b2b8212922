"""Checkpoints that survive a crash, resume, and the final export that reloads anywhere.

A checkpoint is written aside (`.step-N.partial`) and renamed into place only when every rank
has finished writing, so a crash mid-save leaves the previous checkpoint as the newest one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import torch

from .preflight import refuse

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


def save_checkpoint(accelerator, output_dir, step: int) -> Path:
    final = checkpoints_dir(output_dir) / f"step-{step}"
    partial = final.with_name(f".step-{step}.partial")
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))  # model, optimizer, scheduler, RNG: every rank writes its part
    if os.environ.get("RECIPES_TEST_KILL_DURING_SAVE") == str(step):  # fault-injection hook for the tests
        os.kill(os.getpid(), signal.SIGKILL)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (partial / STATE_FILE).write_text(json.dumps({"step": step}) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
    accelerator.wait_for_everyone()
    return final


def resume_from(accelerator, args) -> int:
    """Restore the checkpoint `--resume` names and return its step (0 when starting fresh)."""
    if not args.resume:
        return 0
    if args.resume == "auto":
        found = complete_checkpoints(args.output_dir)
        if not found:
            return 0
        path = found[-1]
    else:
        path = Path(args.resume)
        if not (path / STATE_FILE).is_file():
            refuse(f"--resume {path} is not a complete checkpoint (no {STATE_FILE}); "
                   f"use --resume auto to take the newest complete one in {checkpoints_dir(args.output_dir)}")
    accelerator.load_state(str(path))
    step = json.loads((path / STATE_FILE).read_text())["step"]
    if accelerator.is_main_process:
        print(f"resumed from {path} at step {step}", flush=True)
    return step


def refuse_foreign_checkpoints(args) -> None:
    if not args.resume and complete_checkpoints(args.output_dir):
        refuse(f"{args.output_dir} already holds checkpoints of another run; pass --resume auto to "
               "continue it, or choose a new --output-dir")


def save_full_model(accelerator, model, tokenizer, path: Path) -> None:
    """`model/`: loadable by `AutoModelForCausalLM.from_pretrained`, whatever the strategy.

    `get_state_dict` gathers FSDP shards and ZeRO-3 partitions on every rank (a collective),
    then only the main process writes.
    """
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(path, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(path)
    accelerator.wait_for_everyone()


def save_adapter(accelerator, model, tokenizer, path: Path) -> None:
    """`adapter/`: loadable by `PeftModel.from_pretrained`, checked tensor by tensor.

    peft's `save_pretrained` keeps only the adapter's tensors of the gathered state dict.
    """
    save_full_model(accelerator, model, tokenizer, path)
    if accelerator.is_main_process:
        check_adapter(path)


def check_adapter(path: Path) -> None:
    """Refuse to call a run successful when the saved adapter is empty or untrained."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
    lora = {name: t for name, t in tensors.items() if "lora_" in name}
    if not lora:
        raise RuntimeError(f"{path}: the adapter holds no LoRA tensors")
    for name, tensor in lora.items():
        if tensor.dim() != 2 or tensor.numel() == 0:
            raise RuntimeError(f"{path}: {name} has shape {tuple(tensor.shape)}; a sharded save lost it")
    if all(torch.count_nonzero(t) == 0 for name, t in lora.items() if "lora_B" in name):
        raise RuntimeError(f"{path}: every lora_B is zero; the adapter was never trained or was saved empty")


def merge_adapter(accelerator, base_model: str, adapter, merged, base_4bit: bool = False) -> None:
    """`merged/`: the adapter merged into the base weights, as a plain transformers model.

    Done by the main process in a fresh Python (merge.py): a process outside the training's
    process group loads the base without any FSDP or ZeRO-3 collective, so nothing can hang.
    """
    if accelerator.is_main_process:
        command = [sys.executable, str(Path(__file__).with_name("merge.py")),
                   "--base", str(base_model), "--adapter", str(adapter), "--output", str(merged)]
        clean_env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_ENV_PREFIXES)}
        subprocess.run(command + (["--base-4bit"] if base_4bit else []), check=True, env=clean_env)
    accelerator.wait_for_everyone()


def save_probe(accelerator, model, batch: dict, output_dir) -> None:
    """Logits of the trained model on a fixed batch, so a reload can be compared with it."""
    from safetensors.torch import save_file

    from .evaluation import probe_logits

    batch = {key: value.to(accelerator.device) for key, value in batch.items()}
    logits = probe_logits(model, batch)
    if accelerator.is_main_process:
        save_file({"input_ids": batch["input_ids"].cpu(), "attention_mask": batch["attention_mask"].cpu(),
                   "logits": logits}, str(Path(output_dir) / "probe_logits.safetensors"))
    accelerator.wait_for_everyone()
