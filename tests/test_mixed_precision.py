"""The configs' own mixed precision (bf16: what a GPU launch of them runs) trains under every recipe and
strategy. The equality tests run in float32 (`--mixed_precision no`); here the dtypes meet as on a GPU:
ZeRO-3 keeps the adapters float32 beside a bf16 base with no autocast, FSDP2 settles each parameter group's
gradient dtype at its first forward (the DPO reference's, with the adapters off), pipeline stages run under
the launch's autocast themselves."""

from __future__ import annotations

import math

import pytest

from conftest import launch, long_test

# dpo under fsdp.yaml: its crash is reproduced in-process by tests/test_adapters_off.py on every run
EVERY_RUN = {("lora", "zero3")}
CASES = [("full", "ddp"), ("full", "fsdp"), ("full", "zero3"), ("lora", "zero2"), ("lora", "zero3"),
         ("lora", "fsdp_offload"), ("lora", "pipeline"), ("qlora", "ddp"), ("qlora", "zero3_offload"),
         ("dpo", "ddp"), ("dpo", "fsdp"), ("dpo", "zero3"), ("dpo_full", "fsdp"), ("dpo_full", "zero3")]


@pytest.mark.parametrize("recipe, config", [case if case in EVERY_RUN else pytest.param(*case, marks=long_test)
                                            for case in CASES])
def test_the_configs_bf16_trains(tmp_path, recipe, config):
    stages = ["--pipeline-stages", "2", "--grad-accum", "2"] if config == "pipeline" else []
    run = launch(recipe, tmp_path / "out", "--max-steps", "2", *stages, config=config, mixed_precision=None)
    assert run.returncode == 0, run.output[-3000:]
    assert run.run_json()["mixed_precision"] == "bf16"
    assert len(run.losses()) == 2 and all(math.isfinite(loss) for loss in run.losses())
    if config.startswith("zero") and recipe in ("lora", "qlora", "dpo"):  # the adapters in DeepSpeed's bf16 too
        assert run.run_json()["strategy"]["parameter_dtypes"]["trained"] == ["bfloat16"]
