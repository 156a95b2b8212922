"""FSDP's loading: each process reads from the model's safetensors files only the rows of each weight that its
shards keep (a quarter of the model each on 4 processes; no process holds the whole of it, nothing is sent
between them).

Every process builds the model with unread weights (`modeling.shape_only`: address space, no memory).
`accelerator.prepare` shards that model as it comes (FSDP's `fsdp_cpu_ram_efficient_loading` off for it: no
process has weights to send) and `read_shards` then fills each process's rows from the files
(`runtime.ShardReadingAccelerator`). Where the files cannot be read so (`why_not_read_shards`: a checkpoint
that transformers converts while loading, weights kept in float32 or stored quantized, buffers in the files),
the main process reads the weights and accelerate sends each process its shards, as
`fsdp_cpu_ram_efficient_loading` asks.
"""

from __future__ import annotations

import torch

from ..refusal import refuse
from .model_config import (default_model_needs_building, empty_model, is_default_model, keeps_float32_weights,
                           model_config_object, weight_files)

PEFT_PREFIX = "base_model.model."  # peft's wrapper around the model; its LoRA layers hold the weight in `base_layer`


def weights_of(name: str, trust_remote_code: bool) -> list[str] | None:
    """The names of model `name`'s parameters, as its files should hold them (`names_in_files`); None when
    its config cannot be read here."""
    config = model_config_object(name, trust_remote_code)
    return None if config is None else names_in_files(empty_model(config, trust_remote_code))


def names_in_files(model: torch.nn.Module) -> list[str]:
    """The names of `model`'s parameters as its files hold them: a tied weight once, under the name
    from_pretrained reads it by (ties `model`'s weights, as from_pretrained does)."""
    model.tie_weights()  # a tied LM head is read as the embedding
    return [key for key, _ in model.named_parameters()]


def why_not_read_shards(name: str, trust_remote_code: bool) -> str | None:
    """None where every process can read its shards of model `name` from its files; else why not, in words
    a start-up line can print. Reads the files' index and the config, builds nothing but a meta-device model."""
    if is_default_model(name) and default_model_needs_building():
        return None  # scripts/build_tiny_model.py writes a plain Llama under transformers' own names
    try:
        files = weight_files(name)
    except (OSError, ValueError) as error:
        return f"its files cannot be listed here ({type(error).__name__})"
    config = model_config_object(name, trust_remote_code)
    if files is None or config is None:
        return "it has no safetensors files" if files is None else "its config cannot be read here"
    if getattr(config, "quantization_config", None):
        return "its weights are stored quantized"
    model = empty_model(config, trust_remote_code)
    if keeps_float32_weights(model):
        return "it keeps some weights in float32"
    parameters = dict(model.named_parameters(remove_duplicate=False))
    if any(key not in parameters for key in model.state_dict()):
        return "it keeps buffers in its files"
    missing = [key for key in names_in_files(model) if key not in files]
    if missing:
        return f"its files name the weights otherwise than the model (no {missing[0]})"
    return None


def name_in_files(parameter_name: str) -> str:
    """The name the files give a parameter of the model as the recipe prepares it: peft's wrapper and
    torch.compile's add to the names from_pretrained reads; a module peft trains whole (`modules_to_save`: a
    vision-language model's projector under --train-projector) is read into both its copies."""
    name = parameter_name.replace("_orig_mod.", "")
    name = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
    for wrapped in (".base_layer.", ".modules_to_save.default.", ".original_module."):
        name = name.replace(wrapped, ".")
    return name


def read_shards(model: torch.nn.Module, name: str, trust_remote_code: bool) -> None:
    """Fill, in place, this process's part of each of `model`'s weights from model `name`'s files, once
    accelerate has sharded it: the rows its FSDP shard keeps (a DTensor's local part), or the whole tensor
    where FSDP left it whole. The values are the files' in the parameter's dtype, as from_pretrained converts
    them; parameters the files do not hold (LoRA's adapters) keep theirs. Every weight of the model must be
    found, or the run would train on unread memory: refused in one line otherwise (after loading: the
    names are known once the recipe has wrapped the model)."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    files = weight_files(name)
    by_file: dict[str, list[tuple[torch.Tensor, str]]] = {}
    for parameter_name, parameter in model.named_parameters():
        key = name_in_files(parameter_name)
        if key in files:
            by_file.setdefault(files[key], []).append((parameter, key))
    found = {key for weights in by_file.values() for _, key in weights}
    unread = [key for key in weights_of(name, trust_remote_code) if key not in found]
    if unread:  # the same names on every rank: the same line
        refuse(f"FSDP loading: the prepared model has no weight named {unread[0]} (of {name}'s files), so it "
               "would stay unread; set fsdp_cpu_ram_efficient_loading: false in the accelerate config")
    with torch.no_grad():
        for file, weights in by_file.items():
            with safe_open(file, framework="pt") as handle:
                for parameter, key in weights:
                    stored = handle.get_slice(key)
                    if list(stored.get_shape()) != list(parameter.shape):
                        refuse(f"--model {name}: {key} in {file} has shape {stored.get_shape()}, the model's "
                               f"{list(parameter.shape)}: its files do not match its config.json")
                    if isinstance(parameter, DTensor):
                        local = parameter.to_local()
                        _, offsets = compute_local_shape_and_global_offset(parameter.shape, parameter.device_mesh,
                                                                           parameter.placements)
                    else:
                        local, offsets = parameter, [0] * parameter.dim()
                    if local.numel():
                        rows = tuple(slice(start, start + length) for start, length in zip(offsets, local.shape))
                        local.copy_(stored[rows] if rows else handle.get_tensor(key))  # () : a scalar
    refresh_dora_magnitudes(model)


def refresh_dora_magnitudes(model: torch.nn.Module) -> None:
    """DoRA's magnitude vectors from the weights just read. peft set each to its base weight's row norms when it
    built the adapter, from the weights still unread then; the adapter adds nothing yet (its B is zero), so the
    norms of the rows read are peft's values (a resumed run loads its own over them). A shard keeps the same
    rows of a weight and of its magnitude."""
    from torch.distributed.tensor import DTensor

    def local(tensor):
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    with torch.no_grad():
        for name, module in model.named_modules():
            magnitudes = getattr(module, "lora_magnitude_vector", None)
            if not magnitudes:
                continue
            rows = local(module.get_base_layer().weight)
            for magnitude in magnitudes.values():
                kept = local(magnitude.weight)
                if getattr(module, "fan_in_fan_out", False) or rows.dim() != 2 or rows.shape[0] != kept.shape[0]:
                    refuse(f"--use-dora: {name}'s weight is not split by rows as its magnitude is, so its shard "
                           "cannot give the magnitude; set fsdp_cpu_ram_efficient_loading: false in the accelerate "
                           "config")
                kept.copy_(torch.linalg.norm(rows, dim=1))  # in the weight's dtype, as peft computes it
