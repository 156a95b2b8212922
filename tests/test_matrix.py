"""The recipes under every strategy that runs on CPU: 2 processes through `accelerate launch`.

Each run of the suite launches every config with at least one recipe and every recipe with DDP,
an FSDP and a ZeRO config (tests/strategies.py); RECIPES_LONG_TESTS=1 launches all 30 pairs.

Each launch must (1) really run the asked strategy (several launches exit 0 without
distributing), (2) lower the loss, and (3) leave artifacts that reload in plain transformers /
peft and reproduce the trained model's logits (merged/ on the launches that --merge).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, TINY_MODEL
from strategies import CPU_STRATEGIES, MERGED_IN, PLANNER_NAME, STEPS, matrix_cases

sys.path.insert(0, str(REPO / "recipes"))
from common.model.modeling import keep_4bit_weights_unpacked_on_cpu  # noqa: E402

def reload_logits(recipe: str, output_dir, input_ids, attention_mask) -> dict:
    """Logits of each saved artifact, reloaded the way a user would."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    def logits(model):
        with torch.no_grad():
            return model.eval()(input_ids=input_ids, attention_mask=attention_mask).logits.float()

    if recipe == "full":
        return {"model": logits(AutoModelForCausalLM.from_pretrained(output_dir / "model"))}
    if recipe == "qlora":
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)
        base = AutoModelForCausalLM.from_pretrained(TINY_MODEL, quantization_config=quantization,
                                                    device_map={"": "cpu"}, dtype=torch.float32)
        keep_4bit_weights_unpacked_on_cpu(base)  # as the recipes do: compute in fp32, not bf16
    else:
        base = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    reloaded = {"adapter": logits(PeftModel.from_pretrained(base, output_dir / "adapter"))}
    if (output_dir / "merged").exists():
        reloaded["merged"] = logits(AutoModelForCausalLM.from_pretrained(output_dir / "merged"))
    return reloaded


@pytest.mark.parametrize("recipe, config", matrix_cases())
def test_recipe_runs_strategy(recipe, config, trained, record_property):
    distributed_type, processes, sharded = CPU_STRATEGIES[config]
    run = trained(recipe, config)
    assert run.returncode == 0, run.output[-4000:]
    record_property("launch_seconds", round(run.seconds, 1))  # into --junitxml, for README's table

    # 1. The strategy that was asked for is the one that ran.
    ran = run.run_json()
    assert ran["distributed_type"] == distributed_type
    assert ran["num_processes"] == processes
    total, held = ran["parameters"]["total"], ran["parameters"]["held_by_rank"]
    assert len(held) == processes
    for rank_share in held:
        expected = total / processes if sharded else total
        assert abs(rank_share - expected) <= 0.05 * total, (held, total)
    if config.startswith("zero"):
        assert ran["strategy"]["deepspeed"]["zero_stage"] == int(config[4])
    # The start-up memory plan was made for this very launch.
    assert f"plan: {recipe} with {PLANNER_NAME[config]} on {processes} process(es): " in run.output
    assert "built successfully" not in run.output  # DeepSpeed's notice, printed by every rank as it starts

    # 2. It learned: the loss of the last steps is below that of the first ones.
    losses = run.losses()
    assert len(losses) == STEPS
    assert sum(losses[-2:]) < sum(losses[:2]), losses

    # A person sees sample answers and a model card saying how to load the result.
    samples = [json.loads(line) for line in (run.output_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 and all(sample["prompt"] and "generated" in sample for sample in samples)
    card = (run.output_dir / "README.md").read_text()
    assert ("PeftModel.from_pretrained" if recipe != "full" else "AutoModelForCausalLM.from_pretrained") in card
    assert f"{ran['distributed_type']} x {processes} process(es)" in card

    # The saved tokenizer carries the chat template chat rows are trained with.
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(run.output_dir / ("model" if recipe == "full" else "adapter"))
    assert saved.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<s><|user|>")

    # 3. What it saved reloads and computes what the trained model computed.
    probe = load_file(str(run.output_dir / "probe_logits.safetensors"))
    reloaded = reload_logits(recipe, run.output_dir, probe["input_ids"], probe["attention_mask"])
    assert ("merged" in reloaded) == (recipe != "full" and config == MERGED_IN)  # the launches that --merge
    for artifact, logits in reloaded.items():
        mask = probe["attention_mask"].bool()
        difference = (logits - probe["logits"])[mask].abs().max().item()
        tolerance = 1e-4
        assert difference <= tolerance, f"{artifact}: max logit difference {difference}"
