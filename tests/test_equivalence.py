"""The same seed and global batch give the same loss curve on every strategy.

The one-process launch (model_parallel.yaml on CPU) is the reference; every 2-process
strategy of the matrix must match it step by step. The loss is a mean over the target tokens
of the whole global batch, so this also fails when the normalisation depends on how the
batch is split over ranks or micro-batches.
"""

from __future__ import annotations

import json

import pytest

from conftest import launch
from strategies import CPU_STRATEGIES, SHARDED, matrix_cases

# fp32 on CPU. QLoRA measured: identical to the printed digits on every strategy (max relative
# difference below 1e-6); the bound leaves room for a different CPU kernel order.
TOLERANCE = {"full": 1e-5, "lora": 1e-5, "qlora": 1e-5}
DISTRIBUTED = [config for config in CPU_STRATEGIES if config != "model_parallel"]


def max_relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


@pytest.mark.parametrize("recipe, config", matrix_cases(DISTRIBUTED))
def test_same_loss_curve_as_one_process(recipe, config, trained, record_property):
    reference = trained(recipe, "model_parallel")
    other = trained(recipe, config)
    assert reference.returncode == other.returncode == 0
    difference = max_relative_difference(reference.losses(), other.losses())
    record_property("max_relative_difference", difference)  # into --junitxml, for README's table
    assert difference <= TOLERANCE[recipe], (reference.losses(), other.losses())


def varied_length_rows(path):
    """Rows whose targets range from 1 to ~60 tokens, so per-micro-batch means would differ."""
    with open(path, "w") as file:
        for i in range(64):
            completion = " ".join(str((i * 7 + k) % 10) for k in range(1 + (i * 13) % 40))
            file.write(json.dumps({"prompt": f"Count to {i}: ", "completion": completion}) + "\n")


def test_accumulation_does_not_change_the_updates(tmp_path):
    """micro-batch 1 x accumulation 2 x 2 DDP processes == micro-batch 4 on one process, on rows of
    very different lengths. Both ask for a global batch of 4 (--global-batch-size): the DDP launch
    derives its accumulation from --batch-size 1, the other also picks its micro-batch
    (--batch-size auto: the plan fits more than 4 on this machine, so 4, all the global batch)."""
    dataset = tmp_path / "varied.jsonl"
    varied_length_rows(dataset)
    common = ["--dataset", str(dataset), "--max-steps", "6", "--lr", "5e-3", "--lora-dropout", "0",
              "--global-batch-size", "4"]
    accumulated = launch("lora", tmp_path / "accumulated", *common, "--batch-size", "1", config="ddp")
    whole = launch("lora", tmp_path / "whole", *common, "--batch-size", "auto")
    assert accumulated.returncode == whole.returncode == 0, accumulated.output[-2000:] + whole.output[-2000:]
    for run, (micro, accumulation, processes) in ((accumulated, (1, 2, 2)), (whole, (4, 1, 1))):
        batch = run.run_json()["batch"]
        assert (batch["batch_size"], batch["grad_accum"], batch["global_batch_size"]) == (micro, accumulation, 4)
        assert (f"batch: {micro} per process" in run.output
                and f"--grad-accum {accumulation} x {processes} process(es) = 4 sequences" in run.output)
    assert whole.run_json()["batch"]["planner"]["fits"] >= 4
    assert max_relative_difference(whole.losses(), accumulated.losses()) <= 1e-5
    # Same updates: the gradient norms agree too, not only the losses.
    norms = [[r["grad_norm"] for r in run.metrics()] for run in (whole, accumulated)]
    assert max_relative_difference(*norms) <= 1e-4


@pytest.mark.parametrize("recipe", ["lora", "qlora"])
def test_adapters_from_the_same_seed_agree_across_strategies(recipe, trained):
    """The saved adapters themselves, not only the losses: DDP, FSDP2 and ZeRO-3 write the same tensors.

    (That a second run with the same seed writes identical losses: test_speed_options, whose
    --dataloader-workers launch must repeat the DDP launch's losses exactly.)"""
    from safetensors.torch import load_file

    adapters = {config: load_file(str(trained(recipe, config).output_dir / "adapter" / "adapter_model.safetensors"))
                for config in ("ddp", *SHARDED[recipe])}
    reference = adapters["ddp"]
    # AdamW divides by sqrt(v): elements whose gradients are ~0 amplify float rounding, so after 8
    # steps they differ by up to ~1e-5 (measured) on weights of magnitude ~0.1. A lost shard or an
    # untrained tensor differs by the full magnitude.
    for config, tensors in adapters.items():
        assert tensors.keys() == reference.keys(), config
        for name, tensor in tensors.items():
            bound = 5e-4 * reference[name].abs().max()
            assert (tensor - reference[name]).abs().max() <= bound, f"{config}: {name}"
