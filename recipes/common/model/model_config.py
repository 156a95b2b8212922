"""A model as its config describes it, read without its weights: where the bundled tiny model lives,
the model built on the meta device (no memory), the kinds of its layers (what LoRA can adapt) and the
share of its weights 4-bit loading quantizes. The checks before loading and the loading both read it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from ..paths import DEFAULT_MODEL, REPO_ROOT, is_default_model  # noqa: F401  (model_config.is_default_model, as callers use it)


def default_model_needs_building() -> bool:
    """Not built yet, or built before the bundled tokenizer or config changed (its rows would tokenise
    differently, or its shape or context would not be the bundled one)."""
    saved = DEFAULT_MODEL / "tokenizer.json"
    bundled = REPO_ROOT / "data" / "tokenizer" / "tokenizer.json"
    if not (DEFAULT_MODEL / "config.json").exists() or not saved.exists() or saved.read_bytes() != bundled.read_bytes():
        return True
    built = json.loads((DEFAULT_MODEL / "config.json").read_text())
    wanted = json.loads((REPO_ROOT / "data" / "tiny-llama-config.json").read_text())
    # (a key the installed transformers saves under another name is no change: no rebuild at every start)
    return any(key in built and built[key] != value for key, value in wanted.items())


def weight_files(name: str) -> dict[str, str] | None:
    """{weight name: the safetensors file holding it} of model `name` (a folder, or a hub id, fetched into
    the cache as `from_pretrained` fetches it); None without safetensors files."""
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
    from transformers.utils.hub import cached_file

    def find(filename: str) -> str | None:
        return cached_file(name, filename, _raise_exceptions_for_missing_entries=False)

    index = find(SAFE_WEIGHTS_INDEX_NAME)
    if index:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        files = {shard: find(shard) for shard in set(weight_map.values())}
        return {key: files[shard] for key, shard in weight_map.items()}
    single = find(SAFE_WEIGHTS_NAME)
    if not single:
        return None
    from safetensors import safe_open

    with safe_open(single, framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def keeps_float32_weights(model) -> bool:
    """Whether `model`'s class keeps some weights in float32 whatever the dtype asked (from_pretrained
    upcasts them as it loads, so reading its files tensor by tensor would differ)."""
    return bool(getattr(model, "_keep_in_fp32_modules", None) or getattr(model, "_keep_in_fp32_modules_strict", None))


# peft's LoRA adapts these layer kinds (and Conv1D, transformers' GPT-2 linear)
LINEAR_KINDS = (torch.nn.Linear,)
ADAPTABLE_KINDS = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def meta_model(name: str, trust_remote_code: bool = False):
    """Model `name` built from its config on the meta device (no weights, no memory), a new one each call
    (the checks may change it); None when its config cannot be read here (a hub id not in the cache)."""
    config = model_config_object(name, trust_remote_code)
    if config is None:
        return None
    try:
        return empty_model(config, trust_remote_code)
    except (OSError, ValueError):
        return None


def empty_model(config, trust_remote_code: bool = False, attention: str | None = None, dtype=None):
    """The model of `config` with its parameters on the meta device (in `dtype`; default: the config's) and
    its buffers (the rotary frequencies) computed as usual."""
    from accelerate import init_empty_weights

    extra = {"attn_implementation": attention} if attention else {}
    extra.update({"dtype": dtype} if dtype is not None else {})
    with init_empty_weights(include_buffers=False):
        return model_class(config).from_config(config, trust_remote_code=trust_remote_code, **extra)


def vision_language(config) -> bool:
    """Whether the model of `config` reads images beside text (its config names a vision part)."""
    return getattr(config, "vision_config", None) is not None


def model_class(config):
    """The auto class that builds the model of `config` with its LM head: a vision-language model's image-text-to-
    text class (its vision tower and projector kept), else the causal LM class."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if config is not None and vision_language(config) else AutoModelForCausalLM


@functools.lru_cache(maxsize=4)
def model_config_object(name: str, trust_remote_code: bool = False):
    """transformers' config of model `name`, read once per process (for a hub id, reading it may ask the
    hub); None when it cannot be read here."""
    from transformers import AutoConfig

    try:
        if Path(name).resolve() == DEFAULT_MODEL.resolve() and not (DEFAULT_MODEL / "config.json").exists():
            config = json.loads((REPO_ROOT / "data" / "tiny-llama-config.json").read_text())
            return AutoConfig.for_model(**config)  # the bundled model before its first build
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001  (unreadable here, or a config transformers' own checks reject: the run's
        return None    # later steps say why in their own words)


def module_kinds(name: str, trust_remote_code: bool = False) -> dict[str, str] | None:
    """{module name: "linear" / "adaptable" (LoRA can adapt it) / "other"} of model `name` (from its
    config, `meta_model`); None when its config cannot be read here."""
    from transformers.pytorch_utils import Conv1D

    model = meta_model(name, trust_remote_code)
    if model is None:
        return None
    return {module_name: "linear" if isinstance(module, (*LINEAR_KINDS, Conv1D)) else
            "adaptable" if isinstance(module, ADAPTABLE_KINDS) else "other"
            for module_name, module in model.named_modules() if module_name}


def quantizable_weights(name: str, trust_remote_code: bool = False) -> dict | None:
    """How much of model `name`'s layer weights bitsandbytes quantizes as transformers loads it (from its
    config, `meta_model`): {"quantized": weights, "left": weights, "left_kinds": [module classes]}.

    transformers' bitsandbytes integration replaces modules whose type is exactly torch's nn.Linear (or
    GPT-2's Conv1D); a subclass (Falcon's FalconLinear) or the fused 3-D weights of a mixture of experts
    (MixtralExperts) stay in the float dtype. The output layer is kept in it on purpose, and not counted."""
    from transformers.pytorch_utils import Conv1D

    model = meta_model(name, trust_remote_code)
    if model is None:
        return None
    output = model.get_output_embeddings()
    quantized, left, left_kinds = 0, 0, set()
    for module in model.modules():
        if module is output or isinstance(module, torch.nn.Embedding):
            continue
        weights = sum(p.numel() for p in module.parameters(recurse=False) if p.dim() >= 2)
        if type(module) is torch.nn.Linear or isinstance(module, Conv1D):
            quantized += weights
        elif weights:
            left += weights
            left_kinds.add(type(module).__name__)
    return {"quantized": quantized, "left": left, "left_kinds": sorted(left_kinds)}


def bits_config(bits: int, compute_dtype: torch.dtype, storage: torch.dtype = torch.uint8,
                keep: list[str] | None = None):
    """The recipes' quantisation of a base: NF4 with double quantisation (QLoRA), or LLM.int8(); the modules
    `keep` names (a vision-language model's vision part: `unquantized_modules`) left in the float dtype.
    Also what model/adapters.py and scripts/generate.py load an adapter's base with, as it was trained."""
    from transformers import BitsAndBytesConfig

    skip = {"llm_int8_skip_modules": keep} if keep else {}
    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True, **skip)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=storage, **skip)


def unquantized_modules(name: str, trust_remote_code: bool = False) -> list[str] | None:
    """A vision-language model's modules outside its language model (the vision tower, the projector) and its LM
    head: QLoRA keeps them in 16 bits, as peers do (the tower is small, and frozen). None for a text model."""
    config = model_config_object(name, trust_remote_code)
    if config is None or not vision_language(config):
        return None
    model = empty_model(config, trust_remote_code)
    decoder = model.get_decoder()
    path = next(module_name for module_name, module in model.named_modules() if module is decoder)
    parent = path.rpartition(".")[0]
    holder = model.get_submodule(parent) if parent else model
    head = next(module_name for module_name, module in model.named_modules() if module is model.get_output_embeddings())
    return [f"{parent}.{child}" if parent else child for child, module in holder.named_children()
            if module is not decoder] + [head]
