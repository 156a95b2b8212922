"""What the GPU suite shares: the skip without CUDA, the model it trains, one launch per case.

The suite runs where `torch.cuda.is_available()`; CI and machines without a GPU list its tests
as skipped with the reason. RECIPES_GPU_SUITE_ON_CPU=1 runs its plumbing on CPU instead (fp32,
the configs a CPU can run), to check it before spending GPU time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from conftest import REPO, launch  # noqa: E402

ON_CPU = os.environ.get("RECIPES_GPU_SUITE_ON_CPU") == "1"
HAS_GPU = torch.cuda.is_available()
gpu_suite = pytest.mark.skipif(not (HAS_GPU or ON_CPU),
                               reason="GPU suite: needs a CUDA GPU (python scripts/measure/gpu_check.py runs it there)")
GPUS = torch.cuda.device_count() if HAS_GPU else 0
PRECISION = "bf16" if HAS_GPU else "no"
# A model of TinyLlama-1.1B's shape cut to a few layers: every kernel of the real one, a short launch.
# (The CPU stand-in takes the bundled tiny model's shape: it checks the plumbing, not the kernels.)
SHAPE = REPO / "data" / ("model_configs/tinyllama-1.1b.json" if not ON_CPU else "tiny-llama-config.json")
LAYERS = 2
MODEL_CACHE = Path(os.environ.get("RECIPES_GPU_MODEL_CACHE", REPO / "models"))


def shaped_model(layers: int = LAYERS) -> Path:
    """The random-weight TinyLlama-shaped model with `layers` blocks, built once (scripts/measure/bench)."""
    folder = MODEL_CACHE / f"{SHAPE.stem.removesuffix('-config')}-{layers}-layers"
    if not (folder / "config.json").exists():
        code = ("import sys; sys.path.insert(0, %r); from bench.random_model import build_random_model; "
                "build_random_model(%r, %r, layers=%d)" % (str(REPO / "scripts" / "measure"), str(SHAPE), str(folder), layers))
        subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    return folder


def gpu_launch(recipe: str, output_dir: Path, *recipe_args: str, config: str | None = "model_parallel",
               processes: int | None = None, model: Path | None = None, timeout: int = 900):
    """A launch of `recipe` on this machine's GPUs (one process per GPU unless `processes`), in bf16."""
    processes = processes or max(GPUS, 1)
    args = ["--model", str(model or shaped_model()), "--report-to", "none", *recipe_args]
    return launch(recipe, output_dir, *args, config=config, processes=processes, timeout=timeout,
                  mixed_precision=PRECISION)
