"""The loss a chunk of positions at a time over the last hidden states (model/loss_head.py) is the loss of
the whole logits: the same per-token losses and the same gradients, in float32 and under bf16 autocast; the
whole batch's logits are never kept for the backward; and a model whose logits are more than its head's
output keeps its own logits."""

from __future__ import annotations

import sys

from contextlib import nullcontext

import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))

from common.data.batches import IGNORE, positions_with_targets  # noqa: E402
from common.model.loss_head import LossHead, chunk_positions, settle  # noqa: E402


def tiny_llama(vocab: int = 304):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))


def a_batch(rows: int = 3, length: int = 40, vocab: int = 304):
    """Rows with prompts (no targets) of different lengths and right padding, as the collator gives them."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(4, vocab, (rows, length), generator=generator)
    labels = input_ids.clone()
    for row, (prompt, end) in enumerate([(5, 40), (12, 31), (20, 26)][:rows]):
        labels[row, :prompt] = IGNORE
        labels[row, end:] = IGNORE
    attention_mask = (labels != IGNORE) | (torch.arange(length) < 20)
    return input_ids, attention_mask.long(), labels


# a chunk budget that cuts these tiny batches into several chunks, as 256 MiB cuts a real model's
SMALL_CHUNKS = 3 * 8 * 304 * 4


def token_losses(logits, targets):  # the recipes' loss
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                               ignore_index=IGNORE, reduction="none")
    return losses.view_as(targets)


def losses_and_gradients(model, chunked: bool, autocast: bool = False, gathered: bool = False):
    input_ids, attention_mask, labels = a_batch()
    targets = labels[:, 1:]
    positions = positions_with_targets(targets)
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else None
    model.zero_grad()
    with context() if context else torch.enable_grad():
        if chunked:
            head = LossHead(model.lm_head, None, context or LossHead.autocast, nullcontext if gathered else None,
                            chunk_bytes=SMALL_CHUNKS)
            outputs = model(input_ids=input_ids, attention_mask=attention_mask, **head.forward_arguments(positions))
            per_token = head.apply(token_losses, outputs, targets, positions)
        else:  # the whole logits, every position, the textbook shift
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
            per_token = token_losses(logits, targets)[:, positions]
    per_token.sum().backward()
    return per_token.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def test_chunks_are_several_and_cover_every_target_position():
    _, _, labels = a_batch()
    positions = positions_with_targets(labels[:, 1:])
    size = chunk_positions(3, len(positions), 304, SMALL_CHUNKS)
    assert size == 8 and size < len(positions)  # more than one chunk on this batch
    assert chunk_positions(16, 1024, 32000, 256 * 2**20) == 131  # the headline: 8 chunks of 256 MiB
    assert chunk_positions(3, len(positions), 304, 256 * 2**20) == len(positions)  # fits: one chunk
    assert positions.tolist() == [p for p in range(39) if (labels[:, 1:][:, p] != IGNORE).any()]


def test_chunked_loss_and_gradients_equal_the_whole_logits_in_float32():
    model = tiny_llama()
    chunked, chunked_grads = losses_and_gradients(model, chunked=True)
    whole, whole_grads = losses_and_gradients(model, chunked=False)
    assert chunked.shape == whole.shape and (chunked > 0).sum() == (labels_of_batch() != IGNORE).sum()
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    for name in whole_grads:
        torch.testing.assert_close(chunked_grads[name], whole_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def labels_of_batch():
    return a_batch()[2][:, 1:]


def test_a_frozen_head_gathered_once_a_pass_gives_the_same_loss_and_gradients():
    """ZeRO-3's path for a frozen head (`GatheredChunks`: the forward's chunks without a graph, the backward's
    computed again), here with nothing to gather: the same per-token losses and gradients as the whole logits."""
    model = tiny_llama()
    model.lm_head.requires_grad_(False)
    chunked, chunked_grads = losses_and_gradients(model, chunked=True, gathered=True)
    whole, whole_grads = losses_and_gradients(model, chunked=False)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    for name in whole_grads:
        if whole_grads[name] is not None:
            torch.testing.assert_close(chunked_grads[name], whole_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_chunked_loss_equals_the_whole_logits_under_bf16_autocast():
    """Under mixed precision the head runs in bf16 on each chunk as it does on the whole: the same within
    bf16's round-off (the recomputed chunk in the backward runs under the same autocast)."""
    model = tiny_llama()
    chunked, chunked_grads = losses_and_gradients(model, chunked=True, autocast=True)
    whole, whole_grads = losses_and_gradients(model, chunked=False, autocast=True)
    torch.testing.assert_close(chunked, whole, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(chunked.sum(), whole.sum(), rtol=2e-3, atol=0)
    for name in whole_grads:
        scale = whole_grads[name].abs().max()
        assert (chunked_grads[name] - whole_grads[name]).abs().max() <= 2e-2 * scale + 1e-6, name


def test_the_backward_never_keeps_the_whole_logits():
    """What autograd keeps for the backward: no activation as large as the batch's logits at its target
    positions (rows x positions x vocabulary) on the chunked path; the whole-logits path keeps at least that."""
    vocab = 4096  # a vocabulary much larger than the hidden size, as real models have
    model = tiny_llama(vocab)
    input_ids, attention_mask, labels = a_batch(vocab=vocab)
    targets = labels[:, 1:]
    positions = positions_with_targets(targets)
    logits_size = 3 * len(positions) * vocab
    weights = {param.untyped_storage().data_ptr() for param in model.parameters()}

    def largest_kept(chunked: bool) -> int:
        largest = 0

        def keep(tensor):  # the largest activation kept (the weights are kept either way)
            nonlocal largest
            if tensor.untyped_storage().data_ptr() not in weights:
                largest = max(largest, tensor.numel())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            if chunked:
                head = LossHead(model.lm_head, None, chunk_bytes=3 * 4 * vocab * 4)  # 4 positions a chunk
                outputs = model(input_ids=input_ids, attention_mask=attention_mask,
                                **head.forward_arguments(positions))
                head.apply(token_losses, outputs, targets, positions).sum().backward()
            else:
                outputs = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=positions)
                token_losses(outputs.logits, targets[:, positions]).sum().backward()
        return largest

    assert largest_kept(chunked=False) >= logits_size
    assert largest_kept(chunked=True) < logits_size / 4


class OnCpu:
    """The three things `settle` asks of the Accelerator, for a model in this process."""

    device = torch.device("cpu")
    autocast = LossHead.autocast

    @staticmethod
    def unwrap_model(model):
        return model


def test_a_model_whose_logits_are_its_heads_output_is_chunked():
    head = settle(OnCpu(), tiny_llama())
    assert head.head is not None and head.description == "chunked over the last hidden states"


def test_a_model_with_a_softcap_after_its_head_keeps_its_own_logits():
    """Gemma-2 caps its logits after the head (final_logit_softcapping): chunking the head alone would train
    on other numbers, so the model computes its logits, at the target positions only."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=304, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           final_logit_softcapping=30.0, max_position_embeddings=256))
    head = settle(OnCpu(), model)
    assert head.head is None and "more than its head's output" in head.description
    assert model.training  # settle leaves the model as it found it
    input_ids, attention_mask, labels = a_batch()
    targets = labels[:, 1:]
    positions = positions_with_targets(targets)
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, **head.forward_arguments(positions))
    whole = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    torch.testing.assert_close(head.apply(token_losses, outputs, targets, positions),
                               token_losses(whole, targets)[:, positions])


def test_a_batch_without_any_target_gives_an_empty_loss():
    model = tiny_llama()
    input_ids, attention_mask, labels = a_batch()
    labels[:] = IGNORE
    positions = positions_with_targets(labels[:, 1:])
    head = LossHead(model.lm_head, None)
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, **head.forward_arguments(positions))
    per_token = head.apply(token_losses, outputs, labels[:, 1:], positions)
    assert per_token.shape == (3, 0) and per_token.sum().item() == 0


def test_under_mixed_precision_the_hidden_states_stay_in_bf16_with_the_same_loss_and_gradients():
    """accelerate converts a mixed-precision forward's outputs to float32, every hidden state among them (3 GB at
    the headline); the chunked path keeps them in bf16 and trains on the same numbers (its head casts anyway)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    try:
        model = accelerator.prepare(tiny_llama().to(torch.bfloat16))  # as the adapter recipes load a base model
        head = LossHead(model.lm_head, None, accelerator.autocast, chunk_bytes=SMALL_CHUNKS)
        input_ids, attention_mask, labels = a_batch()
        targets = labels[:, 1:]
        positions = positions_with_targets(targets)

        def step():
            model.zero_grad()
            outputs = model(input_ids=input_ids, attention_mask=attention_mask, **head.forward_arguments(positions))
            per_token = head.apply(token_losses, outputs, targets, positions)
            per_token.sum().backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            return {h.dtype for h in outputs.hidden_states}, per_token.detach(), grads

        converted, losses, grads = step()
        settled = settle(accelerator, model)
        kept, settled_losses, settled_grads = step()
    finally:
        AcceleratorState._reset_state(True)
    assert settled.head is model.lm_head
    assert converted == {torch.float32} and kept == {torch.bfloat16}
    torch.testing.assert_close(settled_losses, losses, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(settled_grads[name], grad, rtol=0, atol=0, msg=name)
