"""The DPO reference's pass, the base with the adapters off (modeling.adapters_off), may be a run's first forward:
under FSDP2 with bf16 mixed precision the next backward must still hand the float32 adapters float32 gradients
(peft's own disable_adapter marked them frozen, FSDP2 settled their groups so, and torch refused the gradients)."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import REPO, free_port

sys.path.insert(0, str(REPO / "recipes"))

from common.model.modeling import adapters_off  # noqa: E402


@pytest.fixture
def one_process_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded_adapted_model():
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=304, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    model = get_peft_model(base.to(torch.bfloat16), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()  # the adapters in float32 over a bf16 base, as the recipes train them
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # accelerate's for bf16
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def test_after_a_first_pass_with_the_adapters_off_they_train_in_float32(one_process_group):
    model = sharded_adapted_model()
    input_ids = torch.randint(4, 304, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), adapters_off(model):
        reference = model(input_ids=input_ids).logits
    model(input_ids=input_ids).logits.float().pow(2).mean().backward()
    grads = [param.grad for name, param in model.named_parameters() if "lora_" in name]
    assert grads and all(grad is not None and grad.dtype == torch.float32 for grad in grads)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)  # (B starts at zero: the adapters add nothing until it moves)
        assert not torch.allclose(model(input_ids=input_ids).logits, reference)
        with adapters_off(model):  # off means off: the base's logits again
            torch.testing.assert_close(model(input_ids=input_ids).logits, reference)
