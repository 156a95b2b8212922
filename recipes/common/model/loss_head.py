"""The recipe's loss without the batch's whole logits: the LM head and the recipe's `token_losses` run a
chunk of positions at a time over the model's last hidden states.

The logits are the step's largest tensor (rows x positions x vocabulary, in float32 for the loss: 2 GiB for
16 rows of 1,024 tokens over a 32,000-token vocabulary). Here no chunk's logits (256 MiB at most) outlive it:
each chunk's loss is kept, and its logits are computed again in the backward (one more pass of the head over
the positions, about 3% of a 1B model's step). Logits that fit one chunk are one, as a plain forward runs. Whatever `token_losses` computes is what trains: the recipe's
own function runs on each chunk (with the chunk's own weights, where the collator gives weights), so an edited
loss trains under every strategy and option.

Where the model's logits are more than its head's output (a softcap or a scale after the head, Gemma-2's
or Cohere's), checked on three tokens when the run starts, the model computes its own logits as it
always has, kept only at the positions with a target; so it does where the head's weight cannot be held
from the forward to the backward (`head_not_held`). Under ZeRO-3 a frozen head is gathered once for the
forward's chunks and once for the backward's (`GatheredChunks`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from itertools import repeat
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

# why_whole of a pipeline's run: its last stage chunks the loss in its schedule (training/pipeline.py)
IN_THE_PIPELINE = "pipeline parallel"

# logits_to_keep for the chunked loss: the model's forward runs its head on its last position only (none would
# do, but an empty index breaks a tensor-parallel head's reshape)
ONE_POSITION = 1


@dataclass(frozen=True)
class LossHead:
    """How a forward's loss is computed, settled once per run (`settle`).

    `head`: the model's LM head, run chunk by chunk over the last hidden states; None where the model's
    own logits are used. `why_whole`: why not chunked (None when chunked). `autocast`: the launch's mixed
    precision context, which the model's forward runs under and the head, called outside it, needs too.
    `gathered`: for a frozen head whose weight ZeRO-3 partitions, a context that holds it whole (DeepSpeed's
    GatheredParameters): gathered once for the forward's chunks and once for the backward's (None elsewhere)."""

    head: torch.nn.Module | None
    why_whole: str | None
    autocast: Callable = nullcontext
    gathered: Callable | None = None
    chunk_bytes: int = 256 * 2**20  # a chunk's float32 logits at most (`chunk_positions`)

    @property
    def description(self) -> str:
        """What run.json records as the loss's path."""
        if self.head is not None:
            return "chunked over the last hidden states"
        if self.why_whole == IN_THE_PIPELINE:
            return "chunked over the last hidden states, in the last pipeline stage's schedule"
        return f"whole logits ({self.why_whole})"

    def forward_arguments(self, positions: torch.Tensor) -> dict:
        """The model's forward arguments for a batch whose targets sit at `positions` (1-D)."""
        if self.head is None:  # the head runs only where some row has a target (a CPU index suits every device)
            return {"logits_to_keep": positions.cpu()}
        return {"logits_to_keep": ONE_POSITION, "output_hidden_states": True}

    def apply(self, figures: Callable, outputs, targets: torch.Tensor, positions: torch.Tensor,
              weights: torch.Tensor | None = None) -> torch.Tensor:
        """`figures(logits, targets)` (the recipe's `token_losses`, or any tensor laid out like its `targets`)
        at `positions`, laid out [rows, positions, ...]: the logits of a chunk of positions at a time
        (`outputs`: the forward's, given `forward_arguments(positions)`). With `weights` (laid out like
        `targets`: the collator's, `batches.target_weights`), `figures(logits, targets, weights)`, each chunk
        given its own."""
        if self.head is None:
            logits = outputs.logits
            return figures_of(figures, logits, at_positions(targets, positions, logits.device),
                              at_positions(weights, positions, logits.device))
        return self.per_chunk(figures, outputs.hidden_states[-1], targets, positions, weights)

    def per_chunk(self, figures: Callable, hidden: torch.Tensor, targets: torch.Tensor,
                  positions: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """`figures(logits, targets)` (a tensor laid out like `targets`) over `hidden`'s `positions`, a chunk of
        positions at a time, concatenated along the positions (`weights`: cut into the same chunks). Under
        autograd each chunk keeps only its result; its logits are recomputed in the backward. Where the whole
        batch's logits fit one chunk, they are one, kept for the backward as a plain forward keeps them
        (nothing to save, nothing to recompute)."""
        hidden = hidden.index_select(1, positions.to(hidden.device))
        targets = at_positions(targets, positions, hidden.device)
        weights = at_positions(weights, positions, hidden.device)
        size = chunk_positions(hidden.shape[0], hidden.shape[1], vocabulary(self.head), self.chunk_bytes)
        if self.gathered is not None:
            return GatheredChunks.apply(hidden, targets, weights, self, figures, size)
        if size >= hidden.shape[1]:
            return self.chunk_figures(figures, hidden, targets, weights)
        pieces = []
        for hidden_chunk, target_chunk, weight_chunk in zip(hidden.split(size, 1), targets.split(size, 1),
                                                            chunks_of(weights, size)):
            if torch.is_grad_enabled():  # no randomness in a head and a loss: no RNG state to keep
                pieces.append(checkpoint(self.chunk_figures, figures, hidden_chunk, target_chunk, weight_chunk,
                                         use_reentrant=False, preserve_rng_state=False))
            else:
                pieces.append(self.chunk_figures(figures, hidden_chunk, target_chunk, weight_chunk))
        return torch.cat(pieces, 1)

    def chunk_figures(self, figures: Callable, hidden: torch.Tensor, targets: torch.Tensor,
                      weights: torch.Tensor | None = None) -> torch.Tensor:
        return figures_of(figures, self.chunk_logits(hidden), targets, weights)

    def chunk_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            if self.gathered is not None:  # the gathered weight itself: a call of the module would partition it
                return torch.nn.functional.linear(hidden, self.head.weight, self.head.bias)
            return self.head(hidden)


class GatheredChunks(torch.autograd.Function):
    """`figures` over the chunks with a frozen head whose weight is gathered for the whole pass (ZeRO-3): the
    forward computes each chunk without a graph; the backward gathers the weight once more and computes each
    chunk again, its gradient with respect to the hidden states only (the head is frozen). One gather a pass
    on every rank, whatever its number of chunks."""

    @staticmethod
    def forward(ctx, hidden, targets, weights, loss_head, figures, size):
        ctx.save_for_backward(hidden, targets, weights)
        ctx.loss_head, ctx.figures, ctx.size = loss_head, figures, size
        with torch.no_grad(), loss_head.gathered():  # (no position with a target: one empty chunk)
            return torch.cat([figures_of(figures, loss_head.chunk_logits(h), t, w) for h, t, w
                              in zip(hidden.split(size, 1), targets.split(size, 1), chunks_of(weights, size))], 1)

    @staticmethod
    def backward(ctx, grad):
        hidden, targets, weights = ctx.saved_tensors
        pieces = []
        with ctx.loss_head.gathered():
            for h, t, w, g in zip(hidden.split(ctx.size, 1), targets.split(ctx.size, 1), chunks_of(weights, ctx.size),
                                  grad.split(ctx.size, 1)):
                with torch.enable_grad():
                    h = h.detach().requires_grad_()
                    figures = figures_of(ctx.figures, ctx.loss_head.chunk_logits(h), t, w)
                    pieces.append(torch.autograd.grad(figures, h, g)[0])
        return torch.cat(pieces, 1), None, None, None, None, None


def figures_of(figures: Callable, logits: torch.Tensor, targets: torch.Tensor,
               weights: torch.Tensor | None) -> torch.Tensor:
    """`figures(logits, targets)`, and the targets' weights too where the batch has some: a loss written without
    weights runs as it always has."""
    return figures(logits, targets) if weights is None else figures(logits, targets, weights)


def at_positions(tensor: torch.Tensor | None, positions: torch.Tensor, device) -> torch.Tensor | None:
    """`tensor`'s columns at `positions`, on `device` (None stays None: a batch without weights)."""
    return None if tensor is None else tensor.index_select(1, positions.to(tensor.device)).to(device)


def chunks_of(tensor: torch.Tensor | None, size: int):
    """`tensor` cut into chunks of `size` positions; for None, None for every chunk."""
    return repeat(None) if tensor is None else tensor.split(size, 1)


def vocabulary(head: torch.nn.Module) -> int:
    return getattr(head, "out_features", None) or head.weight.shape[0]


def chunk_positions(rows: int, positions: int, vocabulary_size: int, chunk_bytes: int) -> int:
    """Positions per chunk: as many as keep a chunk's float32 logits within `chunk_bytes` (at least one). 256 MiB
    keeps the loss's memory at about a gigabyte whatever the batch and vocabulary (128 positions of 16 rows over
    32,000 tokens); a batch whose logits fit is one chunk, with no recomputation."""
    return max(1, min(positions, chunk_bytes // max(rows * vocabulary_size * 4, 1)))


def zero3_partitioned(head: torch.nn.Module) -> bool:
    return any(hasattr(param, "ds_id") for param in head.parameters())


def head_not_held(head: torch.nn.Module) -> str | None:
    """Why the head's weight cannot be used chunk by chunk (None: it can). A trained head whose weight ZeRO-3
    partitions would need its gradient handed to DeepSpeed's partitions (and a module of peft's or another
    kind computes more than its weight's product); an FSDP unit of its own gathers its weight in every call:
    a collective per chunk, and chunks differ between ranks. (A frozen plain linear under ZeRO-3 is gathered
    once a pass: `GatheredChunks`.)"""
    from torch.distributed.fsdp import FSDPModule

    if zero3_partitioned(head):
        if any(param.requires_grad for param in head.parameters()):
            return "ZeRO-3 partitions the trained LM head's weight"
        if type(head) is not torch.nn.Linear:
            return f"ZeRO-3 partitions the LM head, a {type(head).__name__} rather than a plain linear layer"
    if isinstance(head, FSDPModule):
        return "FSDP shards the LM head as a unit of its own, gathered at each call"
    return None


def settle(accelerator, model, stages=None) -> LossHead:
    """The run's loss path, after `accelerator.prepare`: chunked where the model's logits are its head's
    output of its last hidden states, checked on three tokens (every rank runs the same forward: FSDP's and
    tensor parallel's are collective), and the head's weight is held from the forward to the backward
    (FSDP keeps the root's weights, the head's among them under the configs' layer wrapping, gathered in
    between). Pipeline parallel's last stage runs its own (training/pipeline.py: the same chunks in its
    schedule's loss)."""
    if stages:
        return LossHead(None, IN_THE_PIPELINE)
    head = accelerator.unwrap_model(model).get_output_embeddings()
    if head is None:
        return LossHead(None, "the model names no output embeddings")
    why_not = head_not_held(head)
    if why_not:
        return LossHead(None, why_not)
    gathered = None
    if zero3_partitioned(head):
        import deepspeed

        weights = list(head.parameters())
        gathered = lambda: deepspeed.zero.GatheredParameters(weights)  # noqa: E731  (every rank, once a pass)
    chunked = LossHead(head, None, accelerator.autocast, gathered)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ids = torch.tensor([[1, 2, 3]], device=accelerator.device)
            outputs = model(input_ids=ids, use_cache=False, output_hidden_states=True)
            hidden = outputs.hidden_states[-1] if outputs.get("hidden_states") else None
            with gathered() if gathered else nullcontext():
                same = hidden is not None and torch.equal(outputs.logits.float(), chunked.chunk_logits(hidden).float())
    finally:
        model.train(training)
    if not same:
        return LossHead(None, "its logits are more than its head's output of its last hidden states")
    keep_outputs_in_compute_dtype(accelerator.unwrap_model(model))
    return chunked


def keep_outputs_in_compute_dtype(module: torch.nn.Module) -> None:
    """Undo accelerate's conversion of the forward's outputs to float32 under mixed precision (it keeps the
    autocast): with the hidden states asked for, it copies every layer's (about 3 GB at 16 rows of 1,024
    tokens of a 1B model), of which the chunked loss reads the last, cast back by its head's autocast anyway:
    the same numbers. Where the forward is not wrapped so (no mixed precision, DeepSpeed), nothing changes."""
    from types import MethodType

    from accelerate.utils.operations import ConvertOutputsToFp32

    forward = module.__dict__.get("forward")
    converter = getattr(getattr(forward, "__func__", forward), "__wrapped__", None)
    if not isinstance(converter, ConvertOutputsToFp32):
        return
    autocast_forward = converter.model_forward  # accelerate's two ways: a method of the module, or a function
    module.forward = MethodType(autocast_forward, module) if hasattr(forward, "__func__") else autocast_forward
