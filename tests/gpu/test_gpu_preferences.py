"""The preference recipes on the GPUs, in bf16, on a model of TinyLlama-1.1B's shape cut to 2 layers, on the
bundled pairs: dpo.py (LoRA, and QLoRA with --bits 4) and dpo_full.py under the sharded configs and DDP. The
first step's policy is its reference (loss log 2), the held-out chosen replies gain on the rejected ones, and
what was saved reloads in plain peft / transformers to the trained model's logits. Then KTO (kto.py, kto_full.py)
and reward models (reward.py, reward_full.py, saved as sequence classifiers) under a sharded config each.

Runs where CUDA is available (scripts/measure/gpu_check.py, part `preference`); skipped elsewhere, with the reason.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_support import HAS_GPU, gpu_launch, gpu_suite, shaped_model  # noqa: E402
from test_gpu_recipes import check_reloads, check_what_ran  # noqa: E402

pytestmark = gpu_suite

STEPS = 8
# (recipe, config, flags), in order of importance: each recipe under full sharding first, then the rest
CASES = [("dpo", "fsdp", ()), ("dpo_full", "zero3", ()), ("dpo", "zero3", ("--bits", "4")), ("dpo", "ddp", ()),
         ("dpo_full", "fsdp", ()), ("dpo", "fsdp", ("--bits", "4"))]


def case_id(recipe: str, config: str, flags: tuple) -> str:
    return f"{recipe}{'-qlora' if flags else ''}-{config}"


@pytest.mark.parametrize("recipe, config, flags", [pytest.param(*case, id=case_id(*case)) for case in CASES])
def test_preference_recipe_on_gpu(recipe, config, flags, tmp_path, record_property):
    base = shaped_model()
    lr = "1e-5" if recipe == "dpo_full" else "2e-3"
    run = gpu_launch(recipe, tmp_path / "out", "--max-steps", str(STEPS), "--batch-size", "4", "--lr", lr,
                     "--max-length", "256", *flags, config=config, model=base)
    assert run.returncode == 0, run.output[-4000:]
    record_property("launch_seconds", round(run.seconds, 1))

    check_what_ran(run, config, record_property)

    records = run.metrics()
    assert len(records) == STEPS
    # the first step's policy is the reference: both sides' rewards 0, the loss log 2 (bf16's rounding aside)
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-2)
    record_property("losses", json.dumps([round(record["loss"], 4) for record in records]))
    (evaluation,) = run.metrics("eval")
    record_property("eval_margin", round(evaluation["eval_rewards/margins"], 4))
    assert evaluation["eval_rewards/margins"] > 0, evaluation  # the held-out chosen replies gained
    if HAS_GPU:
        record_property("peak_allocated_gib", max(record.get("peak_allocated_gib") or 0 for record in records))

    check_reloads("full" if recipe == "dpo_full" else "qlora" if flags else "lora", run, base, record_property)


# KTO on the same pairs (each two judged replies): its LoRA recipe under full sharding, every weight under ZeRO-3
KTO_CASES = [("kto", "fsdp"), ("kto_full", "zero3")]


@pytest.mark.parametrize("recipe, config", KTO_CASES)
def test_kto_recipe_on_gpu(recipe, config, tmp_path, record_property):
    base = shaped_model()
    lr = "1e-5" if recipe == "kto_full" else "2e-3"
    run = gpu_launch(recipe, tmp_path / "out", "--max-steps", str(STEPS), "--batch-size", "4", "--lr", lr,
                     "--max-length", "256", config=config, model=base)
    assert run.returncode == 0, run.output[-4000:]
    record_property("launch_seconds", round(run.seconds, 1))
    check_what_ran(run, config, record_property)
    records = run.metrics()
    assert len(records) == STEPS
    # the first step's policy is the reference: rewards 0, the KL estimate 0, the loss 1 - sigmoid(0)
    assert records[0]["loss"] == pytest.approx(0.5, abs=1e-2) and all(record["kl"] >= 0 for record in records)
    record_property("losses", json.dumps([round(record["loss"], 4) for record in records]))
    record_property("kl", json.dumps([round(record["kl"], 4) for record in records]))
    if HAS_GPU:
        record_property("peak_allocated_gib", max(record.get("peak_allocated_gib") or 0 for record in records))
    check_reloads("full" if recipe == "kto_full" else "lora", run, base, record_property)


# reward models on the same pairs: LoRA under full sharding, every weight under ZeRO-3
REWARD_CASES = [("reward", "fsdp"), ("reward_full", "zero3")]


@pytest.mark.parametrize("recipe, config", REWARD_CASES)
def test_reward_model_on_gpu(recipe, config, tmp_path, record_property):
    from transformers import AutoModelForSequenceClassification

    base = shaped_model()
    lr = "1e-5" if recipe == "reward_full" else "2e-4"
    run = gpu_launch(recipe, tmp_path / "out", "--max-steps", str(STEPS), "--batch-size", "4", "--lr", lr,
                     "--max-length", "256", config=config, model=base)
    assert run.returncode == 0, run.output[-4000:]
    record_property("launch_seconds", round(run.seconds, 1))
    check_what_ran(run, config, record_property)
    records = run.metrics()
    assert len(records) == STEPS and all(0 <= record["accuracy"] <= 1 for record in records)
    record_property("losses", json.dumps([round(record["loss"], 4) for record in records]))
    if HAS_GPU:
        record_property("peak_allocated_gib", max(record.get("peak_allocated_gib") or 0 for record in records))
    saved = AutoModelForSequenceClassification.from_pretrained(
        run.output_dir / ("merged" if recipe == "reward" else "model"))
    assert saved.config.num_labels == 1  # the family's sequence classifier, one score a row
