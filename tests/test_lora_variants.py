"""peft's LoRA variants as flags: DoRA (`--use-dora`) and rank-stabilised LoRA (`--use-rslora`) train the same
curve under every strategy that runs them, save an adapter plain peft reloads as trained, and are refused in
one line, before the model loads, where they cannot run."""

from __future__ import annotations

import math
import os
import sys
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, TINY_MODEL, launch, long_test
from test_preflight import launched_with

sys.path.insert(0, str(REPO / "recipes"))

from common.launching import settle  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402

VARIANTS = ("--use-dora", "--use-rslora")
# a global batch of 4 rows on every layout: the same updates whatever the split
COMMON = ["--max-steps", "3", "--global-batch-size", "4", "--batch-size", "2", "--lr", "5e-3", *VARIANTS]
PROCESSES = {"model_parallel": 1, "ddp": 2, "fsdp": 2, "fsdp_offload": 2, "zero2": 2, "zero3": 2, "pipeline": 2}
REFERENCE = "ddp"
# fsdp.yaml reads each process's shards after peft built the adapter: DoRA's magnitudes come from the weights read
EVERY_RUN = ()  # the curve under each strategy is a long test; the reload below runs every time


@pytest.fixture(scope="module")
def variant_run(tmp_path_factory):
    runs = {}

    def run(config: str, recipe: str = "lora"):
        if (recipe, config) not in runs:
            output_dir = tmp_path_factory.mktemp(f"{recipe}-{config}") / "out"
            merge = ["--merge"] if config == REFERENCE else []
            runs[recipe, config] = launch(recipe, output_dir, *COMMON, *merge, config=config,
                                          processes=PROCESSES[config])
            assert runs[recipe, config].returncode == 0, runs[recipe, config].output[-3000:]
        return runs[recipe, config]

    return run


def figures(run) -> list[tuple[float, float]]:
    return [(record["loss"], record["grad_norm"]) for record in run.metrics()]


def assert_same_curve(a, b, tolerance: float = 1e-5) -> None:
    for (loss_a, norm_a), (loss_b, norm_b) in zip(figures(a), figures(b), strict=True):
        assert abs(loss_a - loss_b) <= tolerance * abs(loss_a), (figures(a), figures(b))
        assert abs(norm_a - norm_b) <= 1e-4 * abs(norm_a), (figures(a), figures(b))


@pytest.mark.parametrize("config", [*EVERY_RUN, *(pytest.param(config, marks=long_test) for config in
                                                  ("model_parallel", "fsdp", "fsdp_offload", "zero2", "zero3", "pipeline"))])
def test_the_variants_train_the_same_curve_under_every_strategy(variant_run, config):
    assert_same_curve(variant_run(REFERENCE), variant_run(config))


@long_test
@pytest.mark.parametrize("recipe, config", [("qlora", "fsdp_offload"), ("dpo", "fsdp"), ("dpo", "zero3")])
def test_quantized_and_preference_runs_take_them_too(variant_run, recipe, config):
    assert_same_curve(variant_run(REFERENCE, recipe), variant_run(config, recipe))


def test_the_adapter_reloads_with_plain_peft_as_trained(variant_run):
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = variant_run(REFERENCE)
    adapter = run.output_dir / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["use_rslora"] is True
    assert any("lora_magnitude_vector" in name for name in load_file(str(adapter / "adapter_model.safetensors")))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY_MODEL), adapter).eval()
    scalings = {value for module in model.modules() if isinstance(getattr(module, "scaling", None), dict)
                for value in module.scaling.values()}
    assert scalings == {config["lora_alpha"] / math.sqrt(config["r"])}  # rank-stabilised: alpha / sqrt(r)
    probe = load_file(str(run.output_dir / "probe_logits.safetensors"))
    mask = probe["attention_mask"].bool()
    merged = AutoModelForCausalLM.from_pretrained(run.output_dir / "merged").eval()
    with torch.no_grad():
        for reloaded in (model, merged):
            logits = reloaded(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
            assert (logits - probe["logits"])[mask].abs().max().item() <= 1e-4


@pytest.mark.parametrize("recipe, flags, config, refusal", [
    ("lora", [], "tp", "--use-dora cannot run under tensor parallel"),
    ("qlora", ["--bits", "4"], "zero3", "--use-dora with --bits cannot run under ZeRO-3"),
])
def test_where_dora_cannot_run_it_is_refused_in_one_line(tmp_path, recipe, flags, config, refusal):
    args = parse_args(recipe_flags(recipe), ["--use-dora", *flags, "--max-steps", "1", "--output-dir", str(tmp_path)])
    with mock.patch.dict(os.environ), launched_with(config, 4 if config == "tp" else 2), \
            pytest.raises(Refusal, match=refusal):
        settle.settle_launch(args, recipe)
