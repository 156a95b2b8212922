"""Pipeline parallel's loading: each process reads only its stage's weights from the model's safetensors
files (a quarter of a 34B model per process on 4 stages, not all of it in every process).

The model is built from its config on the meta device (no memory; `modeling.empty_model`), cut to this process's stage
(`pipeline.keep_stage`), and only the parameters left are read, tensor by tensor, from the files
(sharded or not, a local folder or the hub's cache). Where the files name the weights otherwise than
the model (a checkpoint transformers converts while loading), where weights are tied, or where the
model keeps some weights in float32, the whole model is loaded as every other strategy loads it and
then cut: the same result, with the whole model in memory for a while.
"""

from __future__ import annotations

import torch

from ..refusal import refuse
from .model_config import keeps_float32_weights, weight_files
from .pipeline_layout import PassThrough, PipelineLayout, decoder_of, keep_stage, split_changes_the_forward


def refuse_a_changed_forward(model) -> None:
    """One line, before any weight loads, when the stages would compute differently from the model's own
    forward (`pipeline.split_changes_the_forward`): checked on `model` (built on the meta device,
    `modeling.empty_model`; changed here) with random weights in its embedding, norm and head, every
    layer passed through."""
    from accelerate.utils import set_module_tensor_to_device

    base, decoder = decoder_of(model)
    decoder.layers = torch.nn.ModuleList(PassThrough() for _ in decoder.layers)
    generator = torch.Generator().manual_seed(0)
    for name, parameter in model.named_parameters(remove_duplicate=False):
        value = torch.randn(parameter.shape, generator=generator, dtype=torch.bfloat16) * 0.02
        set_module_tensor_to_device(model, name, "cpu", value=value)
    problem = split_changes_the_forward(base, decoder)
    if problem:
        refuse(f"pipeline parallel cannot cut {type(base).__name__} into stages: {problem}; use "
               "accelerate_configs/fsdp.yaml")


def load_stage(name: str, model, layout: PipelineLayout, dtype: torch.dtype):
    """(`model`, built from model `name`'s config on the meta device (`modeling.empty_model`), cut to
    `layout`'s stage and its parameters read from `name`'s files in `dtype`, None) - or (None, why not)
    when only a whole load can build it."""
    from accelerate.utils import set_module_tensor_to_device
    from safetensors import safe_open
    from transformers import GenerationConfig

    if model.config.get_text_config().tie_word_embeddings:
        return None, "its LM head is its embedding (tied)"
    if keeps_float32_weights(model):
        return None, "it keeps some weights in float32"
    files = weight_files(name)
    if files is None:
        return None, "it has no safetensors files"
    keep_stage(model, layout)
    wanted = [key for key, _ in model.named_parameters()]
    missing = [key for key in wanted if key not in files]
    if missing:
        return None, f"its files name the weights otherwise (no {missing[0]})"
    by_file: dict[str, list[str]] = {}
    for key in wanted:
        by_file.setdefault(files[key], []).append(key)
    for file, keys in by_file.items():
        with safe_open(file, framework="pt") as handle:
            for key in keys:
                set_module_tensor_to_device(model, key, "cpu", value=handle.get_tensor(key), dtype=dtype)
    model.config.dtype = dtype  # as from_pretrained records it
    try:  # the model's own generation settings travel with the export, as from_pretrained keeps them
        model.generation_config = GenerationConfig.from_pretrained(name)
    except OSError:
        pass
    return model.eval(), None
