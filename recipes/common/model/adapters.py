"""A LoRA adapter as a model: its base with the adapter merged in, as a plain transformers model.

Where a recipe's --model is an adapter folder (the `adapter/` an SFT run saved: adapter_config.json, no
config.json), the run trains the merged model: preference tuning after LoRA SFT starts from the SFT model, and
its reference is that model. The merge is written once per machine into a folder named by the adapter's
contents (RECIPES_CACHE, default ~/.cache/recipes), so every loading path (FSDP's shard reading, ZeRO-3's,
a pipeline stage's) reads it as it reads any model, and a rerun or a resume finds it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .model_config import bits_config

ADAPTER_CONFIG = "adapter_config.json"


def adapter_base(name: str) -> str | None:
    """The base model the LoRA adapter at `name` (a folder) names, or None where `name` is not an adapter
    (a model, or a hub id)."""
    folder = Path(name).expanduser()
    if not (folder / ADAPTER_CONFIG).is_file() or (folder / "config.json").is_file():
        return None
    base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    return str(base) if base else None


def trained_on_4bit(adapter: str) -> bool:
    """Whether the recipe that saved `adapter` (its run.json beside it) trained it on an NF4 base (QLoRA, or the
    preference recipes with --bits 4): then the base it merges onto is that NF4 base, dequantized."""
    record = Path(adapter).expanduser().parent / "run.json"
    if not record.is_file():
        return False
    ran = json.loads(record.read_text())
    return ran.get("recipe") == "qlora" or ran.get("arguments", {}).get("bits") == 4


def merge(base: str, adapter: str, output: str, base_4bit: bool = False, dtype: torch.dtype | None = None,
          trust_remote_code: bool = False) -> None:
    """`adapter` merged into `base`'s weights, saved to `output` as a plain transformers model with the adapter's
    tokenizer (its chat template as trained; the base's where the adapter folder has none). With `base_4bit` the
    base is loaded in NF4, as QLoRA trained against it, and dequantized before the merge. `dtype`: of the merged
    weights (None: the base's)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if base_4bit:
        compute_dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(
            base, quantization_config=bits_config(4, compute_dtype), device_map={"": device}, dtype=compute_dtype,
            trust_remote_code=trust_remote_code).dequantize()
    else:
        model = AutoModelForCausalLM.from_pretrained(base, dtype="auto", trust_remote_code=trust_remote_code)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    if dtype is not None:  # after the merge, which adds the adapter's update in the base's precision
        merged = merged.to(dtype)
    merged.save_pretrained(output, safe_serialization=True)
    tokenizer_source = adapter if (Path(adapter) / "tokenizer_config.json").is_file() else base
    AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=trust_remote_code).save_pretrained(output)


def merged_folder(adapter: str, base: str) -> Path:
    """Where the merge of `adapter` onto `base` is kept: named by the adapter's files and the base's name."""
    digest = hashlib.sha256(base.encode())
    folder = Path(adapter).expanduser()
    for name in sorted(path.name for path in folder.iterdir() if path.name.startswith("adapter_")):
        with open(folder / name, "rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
    root = Path(os.environ.get("RECIPES_CACHE") or Path.home() / ".cache" / "recipes").expanduser()
    return root / "merged" / digest.hexdigest()[:16]


def merged_start_model(adapter: str, base: str, trust_remote_code: bool = False) -> tuple[Path, bool]:
    """(the merged model's folder, whether it was there before this launch: merged by an earlier one). The
    first process of a machine merges (a file lock: the others wait, then find it), into a temporary folder
    renamed into place: whole or absent."""
    from filelock import FileLock

    folder = merged_folder(adapter, base)
    folder.parent.mkdir(parents=True, exist_ok=True)
    there_before = (folder / "config.json").is_file()
    with FileLock(str(folder) + ".lock"):
        if (folder / "config.json").is_file():
            return folder, there_before
        partial = Path(tempfile.mkdtemp(prefix=folder.name + ".partial-", dir=folder.parent))
        try:
            merge(base, adapter, str(partial), base_4bit=trained_on_4bit(adapter), trust_remote_code=trust_remote_code)
            if folder.exists():  # what an interrupted merge of an older version left
                shutil.rmtree(folder)
            partial.replace(folder)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return folder, False
