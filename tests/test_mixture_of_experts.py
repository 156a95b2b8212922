"""Mixture-of-experts models train with the default flags: peft's LoRA on the fused expert weights takes no
dropout (the default becomes 0, said at start-up; a typed one is refused before loading), and the router's
load-balancing loss that the model's config asks for (output_router_logits) is trained beside the recipe's
loss and logged, the same on one process and every strategy (tiny Mixtral- and Qwen3-MoE-shaped models)."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from conftest import REPO, TINY_MODEL, launch, long_test

sys.path.insert(0, str(REPO / "recipes"))
from common.launching import preflight  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402

ROUTER_WEIGHT = 0.05


def build(kind: str, folder, router_loss: bool = True) -> str:
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    torch.manual_seed(0)
    shared = dict(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=3, hidden_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  num_experts_per_tok=2, output_router_logits=router_loss, router_aux_loss_coef=ROUTER_WEIGHT)
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=128, num_local_experts=4, **shared))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                                                   head_dim=16, **shared))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_a_typed_dropout_on_fused_experts_is_refused_before_loading(tmp_path):
    model = build("mixtral", tmp_path / "mixtral")
    args = parse_args(recipe_flags("lora"), ["--model", model, "--lora-dropout", "0.1"])
    with pytest.raises(Refusal, match=r"--lora-dropout 0.1: peft's LoRA on .* fused expert weights takes no dropout; "
                                      "pass --lora-dropout 0, or --lora-targets naming attention layers only"):
        preflight.adapter_dropout(args)
    attention_only = parse_args(recipe_flags("lora"), ["--model", model, "--lora-dropout", "0.1",
                                                       "--lora-targets", "q_proj,v_proj"])
    assert preflight.adapter_dropout(attention_only) == 0.1  # no expert adapted: dropout works


def test_peft_refusing_the_targets_is_one_line_before_loading(tmp_path):
    """Mixtral's w1 and w3 are fused into one weight: peft cannot adapt one without the other."""
    args = parse_args(recipe_flags("lora"), ["--model", build("mixtral", tmp_path / "mixtral"), "--lora-targets", "w1"])
    with pytest.raises(Refusal, match="peft cannot put LoRA on .* with --lora-targets w1: .*change --lora-targets"):
        preflight.adapter_dropout(args)


STRATEGIES = [("model_parallel", 1), ("ddp", 2), ("fsdp", 2)] + ([("zero3", 2)] if os.environ.get("RECIPES_LONG_TESTS") else [])


@pytest.mark.parametrize("kind", [pytest.param("mixtral", marks=long_test), pytest.param("qwen3_moe", marks=long_test)])
def test_lora_on_a_mixture_of_experts_trains_its_router_loss_alike_on_every_strategy(kind, tmp_path):
    """The default flags; micro-batches of 4 rows, 4 per step on one process and 2 per rank on two: the same
    micro-batches, so the router's loss (not linear in the batch) agrees too, not only the token loss."""
    model = build(kind, tmp_path / kind)
    runs = {}
    for config, processes in STRATEGIES:
        runs[config] = launch("lora", tmp_path / config, "--model", model, "--max-steps", "4", "--batch-size", "4",
                              "--grad-accum", str(4 // processes), "--lr", "5e-3", "--log-every", "1",
                              config=config, processes=processes)
        assert runs[config].returncode == 0, runs[config].output[-3000:]
    reference = runs["model_parallel"].metrics()
    assert all(record["router_loss"] > 0 for record in reference)
    for config, _ in STRATEGIES[1:]:
        other = runs[config].metrics()
        for field in ("loss", "router_loss"):
            assert [r[field] for r in other] == pytest.approx([r[field] for r in reference], rel=1e-5), (config, field)
    assert "router_loss" in runs["ddp"].output  # the step lines show it


@pytest.mark.parametrize("recipe", [pytest.param("dpo", marks=long_test), pytest.param("dpo_full", marks=long_test)])
def test_preference_tuning_a_mixture_of_experts_trains_its_router_loss_alike_on_one_process_and_two(recipe, tmp_path):
    """dpo.py / dpo_full.py add the router's loss as the SFT recipes do: logged, and (long) the same on one process
    as on two, micro-batches of 2 pairs (4 rows) alike."""
    model = build("mixtral", tmp_path / "mixtral")
    strategies = [("ddp", 2)] + ([("model_parallel", 1)] if os.environ.get("RECIPES_LONG_TESTS") else [])
    runs = {}
    for config, processes in strategies:
        runs[config] = launch(recipe, tmp_path / config, "--model", model, "--max-steps", "3", "--batch-size", "2",
                              "--grad-accum", str(2 // processes), "--lr", "5e-3" if recipe == "dpo" else "1e-3",
                              config=config, processes=processes)
        assert runs[config].returncode == 0, runs[config].output[-3000:]
    records = runs["ddp"].metrics()
    assert all(record["router_loss"] > 0 for record in records) and records[0]["loss"] == pytest.approx(math.log(2))
    if "model_parallel" in runs:
        for field in ("loss", "router_loss", "rewards/margins"):
            assert [r[field] for r in records] == pytest.approx([r[field] for r in runs["model_parallel"].metrics()],
                                                                rel=1e-5, abs=1e-7), field


def test_the_router_loss_moves_the_updates_and_only_when_the_config_asks(tmp_path):
    """full.py, one process: with output_router_logits the gradient norm differs from the same run
    without it (the router's loss is trained), and a model whose config does not ask logs none."""
    runs = {}
    for asked in (True, False):
        model = build("mixtral", tmp_path / f"mixtral-{asked}", router_loss=asked)
        runs[asked] = launch("full", tmp_path / f"out-{asked}", "--model", model, "--max-steps", "2",
                             "--batch-size", "4", "--lr", "2e-3", processes=1)
        assert runs[asked].returncode == 0, runs[asked].output[-3000:]
    with_router, without = (runs[asked].metrics() for asked in (True, False))
    assert "router_loss" not in without[0] and with_router[0]["router_loss"] > 0
    assert with_router[0]["loss"] == pytest.approx(without[0]["loss"], rel=1e-6)  # the same model and batch
    assert with_router[0]["grad_norm"] != pytest.approx(without[0]["grad_norm"], rel=1e-4)


# The planner counts every expert

@pytest.mark.parametrize("alias, published", [("mixtral-8x7b", 46.7e9), ("qwen3-30b-a3b", 30.5e9)])
def test_the_planner_counts_every_experts_parameters(alias, published):
    from planner.shapes import load_shape

    assert load_shape(alias).parameters == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_the_planners_counts_are_transformers_and_peft_counts(kind, tmp_path):
    """The tiny models: all parameters as transformers builds them (Qwen3's per-head q/k norms aside), and
    the LoRA adapter as peft builds it on the fused experts (gate and up fused, the router adapted too)."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from planner.shapes import load_shape, lora_parameters
    from transformers import AutoModelForCausalLM

    folder = build(kind, tmp_path / kind)
    model = AutoModelForCausalLM.from_pretrained(folder)
    shape = load_shape(folder)
    assert shape.parameters == pytest.approx(sum(p.numel() for p in model.parameters()), rel=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapted = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                                   task_type="CAUSAL_LM"))
    assert lora_parameters(shape, 4) == sum(p.numel() for p in adapted.parameters() if p.requires_grad)


def test_qlora_plans_the_experts_in_the_float_dtype():
    """bitsandbytes leaves the fused expert weights unquantized (test_other_architectures): Mixtral's QLoRA
    holds ~45 B of its 46.7 B parameters as floats, not in 4 bits (~23 GiB for all): bf16 under FSDP
    (~84 GiB), fp32 under DDP, where peft's prepare_model_for_kbit_training upcasts every float weight."""
    from planner.resident import resident_bytes
    from planner.shapes import load_shape

    shape = load_shape("mixtral-8x7b")
    experts = shape.fused_expert_parameters_per_layer() * shape.layers
    assert experts == pytest.approx(45.1e9, rel=0.01)
    assert resident_bytes(shape, "qlora", "fsdp_full_shard", 1)["weights"] == pytest.approx(2 * experts, rel=0.05)
    assert resident_bytes(shape, "qlora", "ddp", 1)["weights"] == pytest.approx(4 * experts, rel=0.05)
