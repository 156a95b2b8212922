"""grpo.py on the GPUs, in bf16, on a model of TinyLlama-1.1B's shape cut to 2 layers (random weights), on the bundled
prompts with the partial-credit reward: under fsdp and zero3 (the weights gathered once per batch of completions)
and ddp. It samples and trains (some groups differ, the gradient is not zero), the adapter reloads in plain peft to
the trained logits, and each step's generation throughput and time are recorded.

Runs where CUDA is available (scripts/measure/gpu_check.py, part `grpo`); skipped elsewhere, with the reason.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_support import HAS_GPU, gpu_launch, gpu_suite, shaped_model  # noqa: E402
from test_gpu_recipes import check_reloads, check_what_ran  # noqa: E402

from conftest import REPO  # noqa: E402

pytestmark = gpu_suite

STEPS = 6
SIMILARITY = f"{REPO / 'recipes' / 'rewards.py'}:answer_similarity"


@pytest.mark.parametrize("config", ["fsdp", "zero3", "ddp"])
def test_grpo_on_gpu(config, tmp_path, record_property):
    base = shaped_model()
    run = gpu_launch("grpo", tmp_path / "out", "--max-steps", str(STEPS), "--batch-size", "16", "--num-generations",
                     "8", "--max-completion-length", "64", "--lr", "1e-4", "--reward", SIMILARITY, "--log-every", "1",
                     config=config, model=base)
    assert run.returncode == 0, run.output[-4000:]
    record_property("launch_seconds", round(run.seconds, 1))
    check_what_ran(run, config, record_property)

    records = run.metrics()
    assert len(records) == STEPS
    assert any(record["grad_norm"] > 0 for record in records), records  # some group's completions differed
    for name in ("generation/tokens_per_s", "generation/seconds", "completions/mean_length", "reward"):
        record_property(name.replace("/", "_"), json.dumps([round(record[name], 3) for record in records]))
    steps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records, records[1:])]
    record_property("step_seconds", json.dumps([round(step, 3) for step in steps]))
    if HAS_GPU:
        record_property("peak_allocated_gib", max(record.get("peak_allocated_gib") or 0 for record in records))
    check_reloads("lora", run, base, record_property)
