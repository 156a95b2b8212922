"""The code paths only a GPU takes: bitsandbytes' CUDA kernels (4- and 8-bit), Liger, the attention
kernels that are installed, --compile, DataLoader workers with pinned memory, and the real step that
confirms --batch-size auto's plan. Each is one LoRA or
QLoRA launch on the 2-layer TinyLlama-shaped model, on one GPU: it must run and learn, and records
its losses and peak memory. Skipped without CUDA, or when the kernel's package is not installed."""

from __future__ import annotations

import json
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_support import HAS_GPU, gpu_launch, gpu_suite  # noqa: E402

pytestmark = gpu_suite
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="a CUDA kernel: not on the CPU stand-in")

CASES = [
    pytest.param("qlora", ["--bits", "4"], id="qlora-nf4"),
    pytest.param("qlora", ["--bits", "8"], id="qlora-int8"),
    pytest.param("lora", ["--attention", "sdpa"], id="sdpa"),
    pytest.param("lora", ["--attention", "eager"], id="eager"),
    pytest.param("lora", ["--attention", "flash_attention_2"], id="flash-attention-2", marks=[
        needs_gpu, pytest.mark.skipif(find_spec("flash_attn") is None, reason="flash-attn is not installed")]),
    pytest.param("lora", ["--liger"], id="liger", marks=[
        needs_gpu, pytest.mark.skipif(find_spec("liger_kernel") is None, reason="liger-kernel is not installed")]),
    pytest.param("lora", ["--compile"], id="compile"),
    pytest.param("lora", ["--no-compile"], id="no-compile"),
    pytest.param("lora", [], id="default"),  # on a CUDA GPU: eager, as 8 planned steps would not repay compiling
    pytest.param("lora", ["--dataloader-workers", "2"], id="dataloader-workers"),
    pytest.param("lora", ["--gradient-checkpointing"], id="gradient-checkpointing"),
]


@pytest.mark.parametrize("recipe, flags", CASES)
def test_speed_option_on_gpu(recipe, flags, tmp_path, record_property):
    run = gpu_launch(recipe, tmp_path / "out", "--max-steps", "8", "--batch-size", "4", "--lr", "2e-3",
                     "--max-length", "256", *flags, config="ddp")
    assert run.returncode == 0, run.output[-4000:]
    losses = run.losses()
    record_property("losses", json.dumps([round(x, 4) for x in losses]))
    record_property("launch_seconds", round(run.seconds, 1))
    if HAS_GPU:
        record_property("peak_allocated_gib", max(r["peak_allocated_gib"] for r in run.metrics()))
        record_property("tokens_per_s", run.metrics()[-1]["tokens_per_s"])
    assert sum(losses[-2:]) < sum(losses[:2]), losses
    if HAS_GPU and not flags:
        assert "speed: --compile off (8 planned steps would not repay compiling" in run.output
        assert run.run_json()["arguments"]["compile"] is False


@pytest.mark.skipif(not HAS_GPU, reason="the --batch-size auto probe runs only on GPUs (batch_size.confirm_on_gpu)")
def test_batch_size_auto_is_confirmed_by_a_real_step(tmp_path, record_property):
    """--batch-size auto on a GPU: the planner's micro-batch for this GPU's memory, then one real
    forward and backward of that size (batch_size.confirm_on_gpu), halving on out-of-memory, and the
    accumulation that keeps --global-batch-size. The plan and the probe take --max-length tokens per
    sequence (the worst case), so 1024 makes them large enough to matter."""
    run = gpu_launch("lora", tmp_path / "out", "--max-steps", "4", "--batch-size", "auto", "--global-batch-size", "64",
                     "--max-length", "1024", "--lr", "2e-3", config="ddp")
    assert run.returncode == 0, run.output[-4000:]
    batch = run.run_json()["batch"]
    record_property("batch", json.dumps(batch))
    assert batch["asked"] == {"batch_size": "auto", "global_batch_size": 64}
    planned = batch["planner"]["fits"]
    ran = batch["confirmed"]["ran"] if "confirmed" in batch else batch["batch_size"]
    assert 1 <= batch["batch_size"] == ran <= planned and 64 % batch["batch_size"] == 0
    assert batch["batch_size"] * batch["grad_accum"] * run.run_json()["num_processes"] == 64
    assert "batch: " in run.output
    peak = max(r["peak_allocated_gib"] for r in run.metrics())
    record_property("peak_allocated_gib", peak)
