"""A LoRA adapter as a model: its base with the adapter merged in, as a plain transformers model.

Where a recipe's --model is an adapter folder (the `adapter/` an SFT run saved: adapter_config.json, no
config.json), the run trains the merged model: preference tuning after LoRA SFT starts from the SFT model, and
its reference is that model. The merge is written once per machine into a folder named by the adapter's
contents (RECIPES_CACHE, default ~/.cache/recipes), so every loading path (FSDP's shard reading, ZeRO-3's,
a pipeline stage's) reads it as it reads any model, and a rerun or a resume finds it.

That folder is only a cache: it also keeps what it was made of (`merged_from/`: the adapter's files and its
base), and the adapter a run trains on it is exported standing alone (`stand_alone`): the two adapters folded
into one on the original base where their sum is exact, else with the merged model saved beside it as `base/`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from . import processors
from .model_config import bits_config, model_class, model_config_object, unquantized_modules
from .score_head import as_sequence_classifier, head_name, put_score_head

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGED_FROM = "merged_from"  # in a merged start model's folder: the adapter's files, and merge.json
SAVED_BASE = "base"  # beside an adapter that cannot be folded: the merged model it was trained on
LORA_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")


def adapter_base(name: str) -> str | None:
    """The base model the LoRA adapter at `name` (a folder) names, or None where `name` is not an adapter
    (a model, or a hub id)."""
    folder = Path(name).expanduser()
    if not (folder / ADAPTER_CONFIG).is_file() or (folder / "config.json").is_file():
        return None
    base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    return moved_base(folder, str(base)) if base else None


def moved_base(adapter: Path, base: str) -> str:
    """`base`, or where it is now: an adapter naming a folder beside it (a run's `base/`) that is gone from its
    path was moved (or copied) with it, and that folder is found beside it again."""
    named = Path(base)
    beside = adapter.resolve().parent / named.name
    if named.is_absolute() and not named.exists() and (beside / "config.json").is_file():
        return str(beside)
    return base


def trained_on_4bit(adapter: str) -> bool:
    """Whether the recipe that saved `adapter` (its run.json beside it) trained it on an NF4 base (QLoRA, or the
    preference recipes with --bits 4): then the base it merges onto is that NF4 base, dequantized."""
    record = Path(adapter).expanduser().parent / "run.json"
    if not record.is_file():
        return False
    ran = json.loads(record.read_text())
    return ran.get("recipe") == "qlora" or ran.get("arguments", {}).get("bits") == 4


def merge(base: str, adapter: str, output: str, base_4bit: bool = False, dtype: torch.dtype | None = None,
          trust_remote_code: bool = False, reward: bool = False) -> None:
    """`adapter` merged into `base`'s weights, saved to `output` as a plain transformers model with the adapter's
    tokenizer (its chat template as trained; the base's where the adapter folder has none). With `base_4bit` the
    base is loaded in NF4, as QLoRA trained against it, and dequantized before the merge. `dtype`: of the merged
    weights (None: the base's). With `reward`, the adapter trained a score head in the LM head's place
    (score_head.py): saved as the family's AutoModelForSequenceClassification."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    auto_class = model_class(model_config_object(base, trust_remote_code))  # a VLM's: its image-text-to-text class
    if base_4bit:
        compute_dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
        model = auto_class.from_pretrained(
            base, quantization_config=bits_config(4, compute_dtype, keep=unquantized_modules(base, trust_remote_code)), device_map={"": device}, dtype=compute_dtype,
            trust_remote_code=trust_remote_code).dequantize()
    else:
        model = auto_class.from_pretrained(base, dtype="auto", trust_remote_code=trust_remote_code)
    if reward:  # the head the adapter's trained copy is loaded into (its values are the adapter's)
        head_key = f"{head_name(model)}.weight"
        put_score_head(model, 0, model.get_input_embeddings().weight.dtype)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    if dtype is not None:  # after the merge, which adds the adapter's update in the base's precision
        merged = merged.to(dtype)
    merged.save_pretrained(output, safe_serialization=True)
    tokenizer_source = adapter if (Path(adapter) / "tokenizer_config.json").is_file() else base
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=trust_remote_code)
    processor = processors.load(tokenizer_source, tokenizer, trust_remote_code, config_from=base)  # a VLM's too
    processors.save(processor or tokenizer, output)
    if reward:
        as_sequence_classifier(Path(output), head_key, tokenizer.pad_token_id)


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
            if not (folder / MERGED_FROM).is_dir():  # merged before the folder kept its origin
                keep_origin(folder, adapter, base)
            return folder, there_before
        partial = Path(tempfile.mkdtemp(prefix=folder.name + ".partial-", dir=folder.parent))
        try:
            merge(base, adapter, str(partial), base_4bit=trained_on_4bit(adapter), trust_remote_code=trust_remote_code)
            keep_origin(partial, adapter, base)
            if folder.exists():  # what an interrupted merge of an older version left
                shutil.rmtree(folder)
            partial.replace(folder)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return folder, False


def keep_origin(folder: Path, adapter: str, base: str) -> None:
    """`folder/merged_from/`: the adapter's weights and config, and merge.json (the adapter folder given, its
    base, whether it was trained on a 4-bit base), so that an adapter trained on the merged model can be
    exported without it (`stand_alone`), whatever becomes of the folder given. Written aside, renamed in."""
    partial = Path(tempfile.mkdtemp(prefix=MERGED_FROM + ".partial-", dir=folder))
    for path in Path(adapter).expanduser().glob("adapter_*"):  # its config and weights (what merged_folder hashes)
        shutil.copyfile(path, partial / path.name)
    record = {"adapter": str(Path(adapter).expanduser().resolve()), "base": base, "base_4bit": trained_on_4bit(adapter)}
    (partial / "merge.json").write_text(json.dumps(record, indent=1) + "\n")
    partial.replace(folder / MERGED_FROM)


def merged_start(model: str) -> dict | None:
    """What the merged start model at `model` was made of ({"adapter", "base", "base_4bit"}, from its
    merged_from/merge.json), or None for any other model."""
    record = Path(model).expanduser() / MERGED_FROM / "merge.json"
    return json.loads(record.read_text()) if record.is_file() else None


def stand_alone(adapter: Path) -> str | None:
    """An adapter exported from a run whose --model was an adapter (trained on the merged model in the cache)
    made to need no cache: a line saying how, or None when its base is no merged start.

    Where both are plain LoRA on unquantized weights, the merged model's weights are the base's plus the first
    adapter's update, and this run's adapter adds its own: the two fold into one LoRA adapter on the original
    base (their ranks side by side), exact and small. Otherwise (DoRA's magnitudes, a 4-bit base, modules
    trained whole) the merged model is saved beside the adapter as `base/` (as large as the model: hard links
    to the cache's files where one file system holds both) and the adapter names it."""
    adapter = Path(adapter)
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    start = config.get("base_model_name_or_path") or ""
    origin = merged_start(start)
    if origin is None:
        return None
    first = Path(start) / MERGED_FROM
    first_config = json.loads((first / ADAPTER_CONFIG).read_text())
    why_not = why_not_fold(first_config, config, origin["base_4bit"], trained_on_4bit(str(adapter)))
    if why_not is None:
        try:
            config, tensors = folded(first_config, lora_weights(first), config, lora_weights(adapter))
        except ValueError as odd:
            why_not = str(odd)
    if why_not is None:
        save_file(tensors, str(adapter / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        base, how = origin["base"], (f"the update of {origin['adapter']} folded in (rank {config['r']}): it loads on "
                                     f"{origin['base']} alone")
    else:
        base = str(save_base(Path(start), adapter.parent / SAVED_BASE))
        how = f"{why_not}, so the merged model it was trained on is saved beside it: {base}"
    renamed(adapter, start, base, config)
    return f"adapter: {adapter} stands alone, {how}"


def lora_weights(folder: Path) -> dict:
    """An adapter's tensors; ValueError where they are not in adapter_model.safetensors (an older peft's .bin)."""
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"the weights of {folder} are not in {ADAPTER_WEIGHTS}")
    return load_file(str(folder / ADAPTER_WEIGHTS))


def why_not_fold(first: dict, second: dict, first_4bit: bool, second_4bit: bool) -> str | None:
    """Why two LoRA adapters' updates cannot be summed as one adapter on the first's base, or None."""
    for name, config in (("the starting adapter", first), ("this run's adapter", second)):
        if config.get("use_dora"):
            return f"{name} is DoRA (its magnitudes scale the weights: no sum)"
        layout = [key for key in ("modules_to_save", "trainable_token_indices", "target_parameters", "rank_pattern",
                                  "alpha_pattern", "layer_replication", "lora_bias") if config.get(key)]
        if config.get("peft_type") != "LORA" or config.get("bias", "none") != "none" or layout:
            return f"{name} has {', '.join(layout) or 'a layout'} beyond LoRA's matrices"
    if first_4bit or second_4bit:
        return f"{'the starting adapter' if first_4bit else 'this run'} trained on a 4-bit base (no sum of updates)"
    if first.get("fan_in_fan_out") != second.get("fan_in_fan_out"):
        return "the two adapters lay their matrices out differently (fan_in_fan_out)"
    return None


def lora_scale(config: dict) -> float:
    """What peft multiplies an adapter's update by: alpha / r (rsLoRA: alpha / sqrt(r))."""
    return config["lora_alpha"] / (config["r"] ** 0.5 if config.get("use_rslora") else config["r"])


def folded(first_config: dict, first: dict, second_config: dict, second: dict) -> tuple[dict, dict]:
    """(config, tensors) of one LoRA adapter whose update is the sum of two: per module, A stacked [A1; A2]
    and B side by side [s1 B1, s2 B2] (each scale folded in, the new scale 1), so B A = s1 B1 A1 + s2 B2 A2; a
    module only one adapter holds gets zeros in the other's place. ValueError on a tensor that is not a LoRA
    matrix (why_not_fold rules those layouts out first)."""
    parts = []
    for config, tensors in ((first_config, first), (second_config, second)):
        matrices = {}
        for key, tensor in tensors.items():
            match = LORA_KEY.fullmatch(key)
            if match is None:
                raise ValueError(f"{key} is not a LoRA matrix (no sum)")
            matrices.setdefault(match.group(1), {})[match.group(2)] = tensor.float()
        parts.append((config["r"], lora_scale(config), matrices))
    modules = sorted(set(parts[0][2]) | set(parts[1][2]))
    rank = parts[0][0] + parts[1][0]
    tensors = {}
    for module in modules:
        present = next(matrices[module] for _, _, matrices in parts if module in matrices)
        inputs, outputs = present["A"].shape[1], present["B"].shape[0]
        a, b = [], []
        for r, scale, matrices in parts:
            pair = matrices.get(module)
            a.append(pair["A"] if pair else torch.zeros(r, inputs))
            b.append(pair["B"] * scale if pair else torch.zeros(outputs, r))
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.cat(a, 0).contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.cat(b, 1).contiguous()
    config = {**second_config, "r": rank, "lora_alpha": rank, "use_rslora": False, "target_modules": modules}
    return config, tensors


def save_base(merged: Path, target: Path) -> Path:
    """The merged model at `merged` (without its merged_from/) as `target`, written aside and renamed in: hard
    links where one file system holds both (no second copy on disk), copies elsewhere."""
    def link_or_copy(source, destination):
        try:
            os.link(source, destination)
        except OSError:
            shutil.copy2(source, destination)

    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(merged, partial, ignore=shutil.ignore_patterns(MERGED_FROM, "*.lock"), copy_function=link_or_copy)
    partial.chmod(target.parent.stat().st_mode & 0o777)  # readable as the run's folder is, not the cache's 0700
    shutil.rmtree(target, ignore_errors=True)
    partial.replace(target)
    return target.resolve()


def renamed(adapter: Path, old: str, new: str, config: dict) -> None:
    """The adapter's config (and peft's README.md beside it) naming `new` as its base instead of `old`."""
    config = {**config, "base_model_name_or_path": new}
    (adapter / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    card = adapter / "README.md"
    if card.is_file():
        card.write_text(card.read_text().replace(old, new))
