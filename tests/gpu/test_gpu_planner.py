"""The planner against the GPU: the per-GPU peak it predicts for the TinyLlama-1.1B shape against
torch.cuda.max_memory_allocated in a real launch (metrics.jsonl's peak_allocated_gib), for full,
LoRA and QLoRA, two micro-batch sizes, with and without gradient checkpointing. Packed sequences
fill every row to --max-length, the length the plan assumes.

Goal (issue "GPU proof"): every prediction within 15% of the measured peak and never more than 5%
below it (a plan that says "fits" must fit). Each case records both figures and their ratio."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_support import HAS_GPU, REPO, gpu_launch, gpu_suite, shaped_model  # noqa: E402

sys.path.insert(0, str(REPO / "recipes"))
import planner  # noqa: E402

pytestmark = [gpu_suite, pytest.mark.skipif(not HAS_GPU, reason="measures GPU memory")]
SEQ_LEN = 1024
SETTINGS = [(2, 0), (4, 0), (4, 1)]  # (micro-batch, gradient checkpointing)


@pytest.mark.parametrize("recipe", ["full", "lora", "qlora"])
@pytest.mark.parametrize("batch, checkpointing", SETTINGS, ids=["batch2", "batch4", "batch4-checkpointing"])
def test_planned_peak_matches_the_measured_one(recipe, batch, checkpointing, tmp_path, record_property):
    model = shaped_model(layers=22)  # the whole TinyLlama-1.1B shape
    flags = ["--max-steps", "2", "--batch-size", str(batch), "--max-length", str(SEQ_LEN), "--packing",
             "--lr", "1e-5"] + (["--gradient-checkpointing"] if checkpointing else [])
    run = gpu_launch(recipe, tmp_path / "out", *flags, config="ddp", model=model)
    assert run.returncode == 0, run.output[-4000:]
    metrics = run.metrics()
    measured = max(r["peak_allocated_gib"] for r in metrics) * 2**30
    record_property("tokens_per_s", metrics[-1]["tokens_per_s"])
    lora = {} if recipe == "full" else {"lora_rank": 16, "lora_targets": "all-linear", "lora_dropout": 0.05}
    predicted = planner.per_gpu_bytes(planner.load_shape(str(model)), recipe, "ddp", 1, batch_size=batch,
                                      seq_len=SEQ_LEN, gradient_checkpointing=checkpointing, precision="bf16",
                                      **lora)["total"]
    ratio = predicted / measured
    record_property("predicted_gib", round(predicted / 2**30, 3))
    record_property("measured_gib", round(measured / 2**30, 3))
    record_property("ratio", round(ratio, 3))
    assert 0.95 <= ratio <= 1.15, f"planned {predicted / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB"
