"""A vision-language model's vision side: its vision tower and projector, found as transformers exposes them, and
the layers of them that train (--train-vision-tower, --train-projector). Imports nothing of the project: the checks
before loading and the memory plan read it as the loading does."""

from __future__ import annotations

import torch

# Where a family keeps its projector inside the vision tower (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: the patch merger that
# maps the tower's patches to the language model's width)
PROJECTORS_IN_THE_TOWER = ("merger", "deepstack_merger_list")


def vision_parts(model) -> tuple[str, list[str]] | None:
    """(the vision tower's module name, the projector's module names) of a vision-language model, found as
    transformers exposes them: the tower is `get_encoder(modality="image")` (LLaVA's, Gemma 3's and PaliGemma's
    vision_tower, Qwen2-VL's visual, Idefics3's and mllama's vision_model); the projector is every other module with
    weights beside the language model (`get_decoder()`) and the tower (multi_modal_projector, Idefics3's connector),
    and the tower's own merger where the family keeps it there (Qwen2-VL). The tower's parts are the tower less the
    projector. None for a text model, or where transformers finds no tower."""
    tower = model.get_encoder(modality="image")
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    names = {id(module): name for name, module in model.named_modules()}
    if tower is model or tower is decoder or id(tower) not in names or id(decoder) not in names:
        return None
    holder_name = names[id(decoder)].rpartition(".")[0]
    holder = model.get_submodule(holder_name) if holder_name else model
    projector = [names[id(module)] for module in holder.children()
                 if module not in (decoder, tower, head) and next(module.parameters(), None) is not None]
    projector += [names[id(module)] for child, module in tower.named_children() if child in PROJECTORS_IN_THE_TOWER]
    return names[id(tower)], projector


def vision_parameters(model) -> dict[str, list]:
    """{"tower": [...], "projector": [...], "unread": [...]}: a vision-language model's parameters of each part (empty
    for a text model), those of the tower the model never reads apart (`unread_modules`: they would get no gradient,
    which DDP refuses)."""
    parts = vision_parts(model)
    if parts is None:
        return {"tower": [], "projector": [], "unread": []}
    tower, projector = parts
    inside = tuple(f"{name}." for name in projector)
    unread = tuple(f"{name}." for name in unread_modules(model, tower))
    named = list(model.named_parameters())
    return {"tower": [param for name, param in named if name.startswith(f"{tower}.")
                      and not name.startswith(inside + unread)],
            "projector": [param for name, param in named if name.startswith(inside)],
            "unread": [param for name, param in named if name.startswith(unread)]}


def unread_modules(model, tower: str) -> list[str]:
    """The tower's modules whose output the model never reads: where the config picks the tower's hidden states by
    `vision_feature_layer` (LLaVA's family: -2, the last block's input, for LLaVA-1.5), the blocks after the deepest
    one picked, and the modules after the encoder that holds the blocks (CLIP's post_layernorm, which only its
    pooled output passes)."""
    config = model.config
    picked = getattr(config, "vision_feature_layer", getattr(config, "vision_feature_layers", None))
    if picked is None:
        return []
    picked = picked if isinstance(picked, (list, tuple)) else [picked]
    blocks = next(((name, module) for name, module in model.get_submodule(tower).named_modules(prefix=tower)
                   if isinstance(module, torch.nn.ModuleList) and len(module)), None)
    if blocks is None:
        return []
    name, layers = blocks
    read = max(index if index >= 0 else len(layers) + 1 + index for index in picked)  # hidden state k: after k blocks
    unread = [f"{name}.{index}" for index in range(read, len(layers))]
    encoder = name.rpartition(".")[0]
    if encoder != tower:  # the modules the tower runs after its encoder
        holder, _, child = encoder.rpartition(".")
        siblings = [sibling for sibling, _ in model.get_submodule(holder).named_children()]
        unread += [f"{holder}.{sibling}" for sibling in siblings[siblings.index(child) + 1:]]
    return unread


def linear_layers(module, prefix: str, targets, skipped: tuple = ()) -> list[str]:
    """The full names of `module`'s linear layers that `targets` ("all-linear" or layer names) picks, as peft's
    target_modules; those under a name in `skipped` left out."""
    return [f"{prefix}.{name}" for name, layer in module.named_modules() if isinstance(layer, torch.nn.Linear)
            and (targets == "all-linear" or name.rsplit(".", 1)[-1] in targets)
            and not f"{prefix}.{name}.".startswith(skipped)]


def tower_linears(model, targets) -> list[str]:
    """The vision tower's linear layers `targets` picks, its projector's left out (it trains whole:
    `projector_modules`); none for a text model."""
    parts = vision_parts(model)
    if parts is None:
        return []
    tower, projector = parts
    skipped = tuple(f"{name}." for name in projector + unread_modules(model, tower))
    return linear_layers(model.get_submodule(tower), tower, targets, skipped)


def projector_modules(model) -> list[str]:
    """A vision-language model's projector, as peft's modules_to_save: trained whole beside the LoRA adapters, saved
    with them (it is small, and maps the tower's features into the language model's space, which a low rank would
    bind)."""
    parts = vision_parts(model)
    return parts[1] if parts else []
