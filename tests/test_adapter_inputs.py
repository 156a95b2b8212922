"""Under mixed precision the adapters take their inputs in the compute dtype (modeling.
keep_adapter_inputs_in_compute_dtype): the same loss and adapter gradients as peft's cast to the float32
weights (autocast runs the matmuls in bf16 either way), without the float32 copies of each adapted layer's
input that the cast wrote (and dropout a second), forward and backward."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))

from common.launching.launch import DDP, DEEPSPEED, Launch  # noqa: E402
from common.model.modeling import keep_adapter_inputs_in_compute_dtype  # noqa: E402


def adapted_model(uncast: bool, precision: str = "bf16"):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=304, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    base = base.to(torch.bfloat16)  # the frozen base in 16 bits, as the recipes load it under bf16
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear"))
    for name, param in model.named_parameters():
        if param.requires_grad:  # the adapters in float32, as the recipes train them
            param.data = param.data.float()
            torch.nn.init.normal_(param, std=0.02)  # B non-zero, so both adapter matrices get gradients
    switched = keep_adapter_inputs_in_compute_dtype(model, Launch(DDP, 1, True, 1, precision)) if uncast else False
    return model, switched


def step(model):
    """One bf16-autocast forward and backward with dropout on: the loss, the adapters' gradients, and the bytes
    of float32 activation-sized tensors the step wrote (a [rows, positions, width] tensor of any width)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ids = torch.randint(4, 304, (2, 24), generator=torch.Generator().manual_seed(1))
    written = 0

    class CountFloat32Activations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal written
            out = func(*args, **(kwargs or {}))
            for tensor in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and tensor.shape[:2] == (2, 24):
                    written += tensor.numel() * 4
            return out

    model.train()
    torch.manual_seed(2)  # the same dropout masks for both
    with torch.autocast("cpu", dtype=torch.bfloat16), CountFloat32Activations():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.requires_grad}
    return loss.item(), grads, written


def test_uncast_inputs_give_the_same_loss_and_gradients_without_float32_copies():
    cast_model, _ = adapted_model(uncast=False)
    uncast_model, switched = adapted_model(uncast=True)
    assert switched
    cast_loss, cast_grads, cast_written = step(cast_model)
    uncast_loss, uncast_grads, uncast_written = step(uncast_model)
    assert abs(uncast_loss - cast_loss) <= 1e-3 * abs(cast_loss)
    for name, grad in cast_grads.items():
        scale = grad.abs().max()
        assert scale > 0, name
        assert (uncast_grads[name] - grad).abs().max() <= 2e-2 * scale, name
        assert uncast_grads[name].dtype == torch.float32  # the weights (and so the optimizer's state) stay float32
    # what stays float32 either way: the norms' upcasts, the logits and the loss
    assert cast_written > 0 and uncast_written < cast_written / 2, (cast_written, uncast_written)


@pytest.mark.parametrize("launch, autocasts", [
    (Launch(DDP, 2, True, 1, "bf16"), True),
    (Launch(DDP, 2, True, 1, "no"), False),
    (Launch(DDP, 2, True, 1, "bf16", pipeline_stages=2), True),  # the stages run under the same autocast
    (Launch(DEEPSPEED, 2, True, 1, "bf16", zero_stage=3), False),  # no autocast: the adapters take bf16 instead
])
def test_peft_keeps_its_cast_only_where_the_adapters_and_their_inputs_could_differ(launch, autocasts):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    model = get_peft_model(LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=1, num_attention_heads=2)),
                           LoraConfig(r=2, target_modules="all-linear"))
    assert launch.autocasts == autocasts
    assert keep_adapter_inputs_in_compute_dtype(model, launch) == (launch.precision != "no")
    assert all(module.cast_input_dtype_enabled != autocasts for module in model.modules()
               if hasattr(module, "cast_input_dtype_enabled"))
    # DeepSpeed's bf16 without autocast: the adapters in bf16, as DeepSpeed casts every other weight
    trained = {param.dtype for param in model.parameters() if param.requires_grad}
    assert trained == ({torch.bfloat16} if launch.casts_weights else {torch.float32})
