"""Cutting a causal LM into pipeline stages: which decoder layers each process holds (`PipelineLayout`),
what cannot be cut (checked before loading), and the cut itself on a built model (`keep_stage`). The
schedules that run the stages are in pipeline.py; reading only a stage's weights in stage_loading.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..refusal import refuse


@dataclass(frozen=True)
class PipelineLayout:
    """Where this process sits: `stages` processes per pipeline x `replicas` pipelines; rank = replica *
    stages + stage. Under the interleaved schedule each process runs `chunks` stages of the layers: the
    layers are cut into stages * chunks parts, and process `stage` runs parts stage, stage + stages, ..."""

    stages: int
    replicas: int
    rank: int
    layers: int  # decoder layers of the model
    chunks: int = 1

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def parts(self) -> int:
        """The stages the layers are cut into (the schedule's stages)."""
        return self.stages * self.chunks

    def parts_of(self, stage: int | None = None) -> list[int]:
        """The parts process `stage` (default: this one) runs, in the order the data meets them."""
        stage = self.stage if stage is None else stage
        return [stage + chunk * self.stages for chunk in range(self.chunks)]

    def held_layers(self) -> list[int]:
        """The decoder layers this process holds (of every part it runs)."""
        return [index for part in self.parts_of() for index in self.layer_range(part)]

    def rank_of(self, part: int) -> int:
        """The rank in this pipeline that runs `part`."""
        return self.replica * self.stages + part % self.stages

    @property
    def replica(self) -> int:
        return self.rank // self.stages

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def layer_range(self, part: int) -> range:
        """The contiguous layers of `part` (of `parts`): the first `layers % parts` parts get one more, as
        `device_map="auto"` balances model parallel."""
        base, extra = divmod(self.layers, self.parts)
        start = part * base + min(part, extra)
        return range(start, start + base + (1 if part < extra else 0))


def check_layout(stages: int, processes: int, layers: int | None = None, chunks: int = 1) -> None:
    """One line before the model loads when the sizes cannot work."""
    if stages < 1:
        refuse(f"--pipeline-stages must be >= 1, not {stages}")
    if chunks < 1:
        refuse(f"--pipeline-chunks must be >= 1, not {chunks}")
    if processes % stages:
        refuse(f"--pipeline-stages {stages} does not divide the {processes} processes: launch a multiple of "
               f"{stages} (each pipeline of {stages} stages is replicated over the rest)")
    if layers is not None and stages > layers:
        refuse(f"--pipeline-stages {stages} is more than the model's {layers} decoder layers: use at most {layers}")
    if layers is not None and stages * chunks > layers:
        fix = (f"use --pipeline-chunks {layers // stages} or fewer" if layers // stages > 1 else
               "too few to interleave: use --pipeline-schedule 1f1b")
        refuse(f"--pipeline-stages {stages} x --pipeline-chunks {chunks} cuts the model's {layers} decoder layers "
               f"into {stages * chunks} parts, more than there are: {fix}")


class PassThrough(torch.nn.Module):
    """A decoder layer this stage does not run: its input is its output."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def decoder_of(model):
    """The decoder (embedding, layers, norm) of a causal LM, inside peft's wrapper too."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base, base.get_decoder()


def unstageable(model) -> str | None:
    """Why `model` cannot be cut into stages here (None: it can): the split needs a decoder with
    `embed_tokens`, a list of `layers` and a final `norm`, and an `lm_head` (the Llama family: Llama,
    Mistral, Qwen, Gemma, Phi-3, ...)."""
    try:
        base, decoder = decoder_of(model)
    except (AttributeError, NotImplementedError):
        return f"{type(model).__name__} names no decoder (get_decoder)"
    missing = [name for name in ("embed_tokens", "layers", "norm") if not hasattr(decoder, name)]
    if not isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):
        missing.append("layers as a list")
    if not hasattr(base, "lm_head"):
        missing.append("lm_head")
    return f"{type(decoder).__name__} has no {', '.join(dict.fromkeys(missing))}" if missing else None


@torch.no_grad()
def split_changes_the_forward(base, decoder) -> str | None:
    """What the stages would compute differently from the model's own forward (None: nothing), checked on
    three tokens with every layer passed through:
    - a later stage hands the previous stage's output to the decoder as `inputs_embeds`, so the forward
      must take them as the residual stream unchanged (without its final norm, what goes in comes out);
      a forward that scales its input embeddings would scale them again;
    - the last stage computes `lm_head` of the decoder's output, so the model's logits must be just that
      (no softcapping or scaling after the head)."""
    layers, norm, training = decoder.layers, decoder.norm, base.training
    decoder.layers = torch.nn.ModuleList(PassThrough() for _ in layers)
    base.eval()
    try:
        weight = decoder.embed_tokens.weight
        ids = torch.tensor([[1, 2, 3]], device=weight.device)
        logits = base(input_ids=ids, use_cache=False).logits
        if not torch.equal(logits, base.lm_head(decoder(input_ids=ids, use_cache=False).last_hidden_state)):
            return "its logits are not just lm_head of its last hidden states (a softcap or scale follows the head)"
        decoder.norm = torch.nn.Identity()
        given = torch.randn(1, 3, weight.shape[1], dtype=weight.dtype, device=weight.device)
        if not torch.equal(decoder(inputs_embeds=given, use_cache=False).last_hidden_state, given):
            return "its forward changes the input embeddings it is given (a later stage would change the previous one's output)"
    finally:
        decoder.layers, decoder.norm = layers, norm
        base.train(training)
    return None


def keep_stage(model, layout: PipelineLayout):
    """Drop from `model` what this process does not run (in place; again changes nothing): the layers of
    the other stages become pass-throughs, the embedding stays on the first stage only, the final norm
    and LM head on the last. Returns (the causal LM, its decoder)."""
    problem = unstageable(model)
    if problem:  # (preflight refuses it before loading when it can build the model from its config)
        refuse(f"pipeline parallel cannot cut this model into stages: {problem}; use fsdp.yaml")
    base, decoder = decoder_of(model)
    held = set(layout.held_layers())
    for index in range(len(decoder.layers)):
        if index not in held:
            decoder.layers[index] = PassThrough()
    if not layout.is_first:
        decoder.embed_tokens = None  # the hidden states arrive from the previous stage
    if not layout.is_last:
        decoder.norm = torch.nn.Identity()
        base.lm_head = None
    return base, decoder


def layout_of(accelerator, launch, layers: int) -> PipelineLayout:
    """This process's place in the launch's pipelines, for a model of `layers` decoder layers."""
    return PipelineLayout(launch.pipeline_stages, launch.data_parallel_size, accelerator.process_index, layers,
                          launch.pipeline_chunks)
