"""Not only Llama: LoRA targets come from the model's own linear layers and FSDP wraps the
model's own block class (GPT-2: Conv1D projections, tied embeddings; Qwen2: attention biases)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_MODEL, launch, long_test


def build(kind: str, folder) -> None:
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    torch.manual_seed(0)
    special = dict(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=3)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_positions=512, n_embd=64, n_layer=2, n_head=4, **special))
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
