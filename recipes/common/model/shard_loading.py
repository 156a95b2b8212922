"""FSDP's loading: each process reads from the model's safetensors files only the rows of each weight that its
shards keep (a quarter of the model each on 4 processes; no process holds the whole of it, nothing is sent
between them).

Every process builds the model with unread weights (`unread_model`: address space, no memory), each weight
marked with the file and the name that hold it. `accelerator.prepare` shards that model as it comes (FSDP's
`fsdp_cpu_ram_efficient_loading` off for it: no process has weights to send) and `read_shards` then fills each
process's rows from the files. Where the files cannot be read so (`why_not_read_shards`: a checkpoint that
transformers converts while loading, weights kept in float32 or stored quantized, buffers in the files), the
main process reads the weights and accelerate sends each process its shards, as `fsdp_cpu_ram_efficient_loading`
asks.
"""

from __future__ import annotations

import torch

from .model_config import default_model_needs_building, empty_model, is_default_model, model_config_object
from .stage_loading import weight_files

FILES_SLOT = "_weight_in_files"  # on each unread parameter: (its safetensors file, its name there)


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
    model.tie_weights()  # as from_pretrained ties them: a tied LM head is read as the embedding
    if getattr(model, "_keep_in_fp32_modules", None) or getattr(model, "_keep_in_fp32_modules_strict", None):
        return "it keeps some weights in float32"
    parameters = dict(model.named_parameters(remove_duplicate=False))
    if any(key not in parameters for key in model.state_dict()):
        return "it keeps buffers in its files"
    missing = [key for key, _ in model.named_parameters() if key not in files]
    if missing:
        return f"its files name the weights otherwise than the model (no {missing[0]})"
    return None


def unread_model(name: str, build) -> torch.nn.Module:
    """The model `build()` returns (its weights unread: `modeling.shape_only`), each parameter marked with the
    safetensors file and name its values are in, for `read_shards` once accelerate has sharded it."""
    files = weight_files(name)
    model = build()
    for key, parameter in model.named_parameters():  # a tied weight once, under its first name
        setattr(parameter, FILES_SLOT, (files[key], key))
    return model


def unread_weights(model: torch.nn.Module) -> dict[str, tuple[str, str]]:
    """{parameter name in `model` as it is now (peft's wrapping included): (file, name in the file)} of the
    parameters `unread_model` left unread."""
    return {name: getattr(parameter, FILES_SLOT) for name, parameter in model.named_parameters()
            if hasattr(parameter, FILES_SLOT)}


def read_shards(model: torch.nn.Module, unread: dict[str, tuple[str, str]]) -> None:
    """Fill, in place, this process's part of each parameter in `unread` (`unread_weights`, taken before
    `accelerator.prepare`) from the files: the rows its FSDP shard keeps (a DTensor's local part), or the
    whole tensor where FSDP left it whole. The values are the files' in the parameter's dtype, as
    from_pretrained converts them."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper keeps the names under it
    parameters = dict(model.named_parameters())
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name, (file, key) in unread.items():
        if name not in parameters:
            raise RuntimeError(f"FSDP loading: {name} is no longer in the prepared model, so its weights would stay "
                               "unread; set fsdp_cpu_ram_efficient_loading: false in the accelerate config")
        by_file.setdefault(file, []).append((name, key))
    with torch.no_grad():
        for file, weights in by_file.items():
            with safe_open(file, framework="pt") as handle:
                for name, key in weights:
                    parameter = parameters[name]
                    stored = handle.get_slice(key)
                    if list(stored.get_shape()) != list(parameter.shape):
                        raise RuntimeError(f"{key} in {file} has shape {stored.get_shape()}, the model's "
                                           f"{list(parameter.shape)}: the files do not match the model's config")
                    if isinstance(parameter, DTensor):
                        local = parameter.to_local()
                        _, offsets = compute_local_shape_and_global_offset(parameter.shape, parameter.device_mesh,
                                                                           parameter.placements)
                    else:
                        local, offsets = parameter, [0] * parameter.dim()
                    if local.numel():
                        rows = tuple(slice(start, start + length) for start, length in zip(offsets, local.shape))
                        local.copy_(stored[rows] if rows else stored[:])
