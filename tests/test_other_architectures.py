"""Not only Llama: LoRA targets come from the model's own linear layers and FSDP wraps the
model's own block class (GPT-2: Conv1D projections, tied embeddings; Qwen2: attention biases)."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, TINY_MODEL, launch, long_test

sys.path.insert(0, str(REPO / "recipes"))


def build(kind: str, folder) -> None:
    from transformers import (AutoTokenizer, FalconConfig, FalconForCausalLM, GPT2Config, GPT2LMHeadModel, MixtralConfig,
                              MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    torch.manual_seed(0)
    special = dict(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=3)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_positions=512, n_embd=64, n_layer=2, n_head=4, **special))
    elif kind == "falcon":  # its projections are FalconLinear, a subclass of nn.Linear
        model = FalconForCausalLM(FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **special))
    elif kind == "mixtral":  # a mixture of experts: the experts' weights are fused 3-D tensors
        model = MixtralForCausalLM(MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                                 num_experts_per_tok=2, max_position_embeddings=512, **special))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=512, **special))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.mark.parametrize("kind, recipe, config", [
    ("gpt2", "lora", "fsdp"),
    pytest.param("qwen2", "full", "zero3", marks=long_test),  # ~21 s
])
def test_other_architectures_train_shard_and_reload(kind, recipe, config, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / kind
    build(kind, model_dir)
    run = launch(recipe, tmp_path / "out", "--model", str(model_dir), "--max-steps", "6", "--batch-size", "4",
                 "--lr", "5e-3", config=config)
    assert run.returncode == 0, run.output[-3000:]
    ran = run.run_json()
    held, total = ran["parameters"]["held_by_rank"], ran["parameters"]["total"]
    assert all(abs(share - total / 2) <= 0.05 * total for share in held), (held, total)
    losses = run.losses()
    assert losses[-1] < losses[0]

    probe = load_file(str(run.output_dir / "probe_logits.safetensors"))
    if recipe == "lora":
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), run.output_dir / "adapter")
    else:
        reloaded = AutoModelForCausalLM.from_pretrained(run.output_dir / "model")
    with torch.no_grad():
        logits = reloaded.eval()(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    mask = probe["attention_mask"].bool()
    assert (logits - probe["logits"])[mask].abs().max() <= 1e-4


def test_a_model_without_logits_to_keep_gets_the_logits_asked_for():
    """Remote code whose forward lacks `logits_to_keep`: the recipes' loss still gets the logits of
    the positions it asks for (computed for every position, then kept)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from common.model import modeling

    class NoLogitsToKeep(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            assert "logits_to_keep" not in kwargs
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    reference = AutoModelForCausalLM.from_pretrained(TINY_MODEL).eval()
    model = NoLogitsToKeep.from_pretrained(TINY_MODEL).eval()
    modeling.accept_logits_to_keep(model)
    modeling.accept_logits_to_keep(reference)  # a model that takes it is left as it is
    assert "forward" not in vars(reference)
    input_ids = torch.randint(4, 300, (2, 9))
    positions = torch.tensor([2, 3, 7])
    with torch.no_grad():
        everything = reference(input_ids=input_ids).logits
        kept = model(input_ids=input_ids, logits_to_keep=positions).logits
        last = model(input_ids=input_ids, logits_to_keep=1).logits
    assert torch.allclose(kept, everything[:, positions], atol=1e-6)
    assert torch.allclose(last, everything[:, -1:], atol=1e-6)


def test_qlora_of_a_model_bitsandbytes_would_not_quantize_is_refused_before_it_loads(tmp_path):
    """Falcon's FalconLinear is not torch's nn.Linear, so transformers' 4-bit loading quantizes nothing:
    the run would be plain LoRA on a full-precision base under QLoRA's name."""
    build("falcon", tmp_path / "falcon")
    run = launch("qlora", tmp_path / "out", "--model", str(tmp_path / "falcon"), "--max-steps", "2", config="ddp")
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert run.returncode != 0 and len(errors) == 1, run.output[-3000:]
    assert "bitsandbytes would quantize none of" in errors[0] and "(FalconLinear:" in errors[0]
    assert "use recipes/lora.py" in errors[0] and "model: loading the weights" not in run.output


def test_qlora_says_which_layers_stay_unquantized_and_records_the_quantized_weights(tmp_path):
    """Mixtral: attention is quantized, the experts' fused weights are not (bitsandbytes replaces nn.Linear
    only); the start-up line gives the share, run.json the counts."""
    build("mixtral", tmp_path / "mixtral")
    run = launch("qlora", tmp_path / "out", "--model", str(tmp_path / "mixtral"), "--max-steps", "2",
                 "--batch-size", "2", config="ddp")  # the default --lora-dropout 0 suits the experts
    assert run.returncode == 0, run.output[-3000:]
    [line] = [line for line in run.output.splitlines() if line.startswith("quantization: ")]
    assert line.startswith("quantization: 4-bit on ") and "MixtralExperts" in line, line
    ran = run.run_json()
    plan = ran["arguments"]["quantization_plan"]
    assert plan["quantized"] > 0 and plan["left"] > plan["quantized"] and "MixtralExperts" in plan["left_kinds"]
    assert ran["parameters"]["quantized"] == plan["quantized"]  # what loaded is what preflight read from the config
