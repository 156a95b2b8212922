"""The offline model: a Llama of a workload's shape with random bf16 weights, built once into the model cache."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.paths import REPO, TINY_MODEL, TOKENIZER_DIR
from bench.shapes import shape_of
from bench.workloads import Workload

BUILD_SNIPPET = """
import sys
sys.path.insert(0, {scripts!r})
from bench.random_model import build_random_model
build_random_model({config!r}, {output!r}, layers={layers!r}, seed={seed!r})
"""


def build_random_model(config_path: str, output_dir: str, layers: int | None = None, seed: int = 0) -> None:
    """A Llama of `config_path`'s shape (with `layers` blocks when given), random weights as bf16
    safetensors (normal(0, initializer_range); norm weights 1), the bundled tokenizer beside it.

    Tensors are generated one at a time (on the GPU when there is one) and written in shards of at most
    5 GB, so a 34B model never needs its 63 GiB in memory at once. Written to a temporary folder and
    renamed into place when complete. Run in its own process by `ensure_model` (it may touch the GPU).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    output = Path(output_dir)
    raw = json.loads(Path(config_path).read_text())
    if layers:
        raw["num_hidden_layers"] = int(layers)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    raw["pad_token_id"] = tokenizer.pad_token_id
    raw["dtype"] = "bfloat16"
    config = LlamaConfig.from_dict(raw)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in skeleton.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # the same tensor as the embedding
    del skeleton

    # Shards of at most 5 GB, planned first so that each is generated, written and freed in turn.
    shard_limit = 5 * 10**9
    plan, current, current_bytes = [], [], 0
    for name, shape in shapes.items():
        size = math.prod(shape) * 2
        if current and current_bytes + size > shard_limit:
            plan.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    plan.append(current)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(seed)
    std = float(raw.get("initializer_range", 0.02))
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        weight_map, total = {}, 0
        for index, names in enumerate(plan, start=1):
            file = "model.safetensors" if len(plan) == 1 else f"model-{index:05d}-of-{len(plan):05d}.safetensors"
            shard = {}
            for name in names:
                if len(shapes[name]) == 1:  # RMSNorm weights
                    shard[name] = torch.ones(shapes[name], dtype=torch.bfloat16)
                else:
                    tensor = torch.empty(shapes[name], dtype=torch.bfloat16, device=device)
                    shard[name] = tensor.normal_(0.0, std, generator=generator).cpu()
                weight_map[name] = file
                total += shard[name].numel() * shard[name].element_size()
            save_file(shard, str(tmp / file), metadata={"format": "pt"})
            del shard
        if len(plan) > 1:
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "BUILT").write_text(json.dumps({"config": str(config_path), "layers": raw["num_hidden_layers"],
                                               "seed": seed, "bytes": total}) + "\n")
        if output.exists():
            shutil.rmtree(output)  # an incomplete folder (no BUILT marker) left by an interrupted build
        os.replace(tmp, output)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_model(workload: Workload, layers: int, cache: Path, dry_run: bool = False) -> Path:
    """The model folder of `workload` with `layers` blocks, built when absent (in its own process)."""
    if workload.config is None:
        if not (TINY_MODEL / "config.json").exists() and not dry_run:
            subprocess.run([sys.executable, str(REPO / "scripts" / "build_tiny_model.py")], check=True, cwd=REPO)
        return TINY_MODEL
    folder = cache / f"{workload.config.stem}-{layers}L"
    if (folder / "BUILT").exists() or dry_run:
        return folder
    shape = shape_of(workload.config, layers)
    need = shape.parameters * 2
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    if free < need * 1.05:
        sys.exit(f"error: {cache} has {free / 2**30:.1f} GiB free but the {layers}-layer model needs "
                 f"{need / 2**30:.1f} GiB of bf16 weights; free some disk, choose --model-cache elsewhere, "
                 "or build fewer layers with --layers N")
    print(f"building {folder} ({shape.parameters / 1e9:.2f} B parameters, random bf16 weights) ...", flush=True)
    started = time.perf_counter()
    snippet = BUILD_SNIPPET.format(scripts=str(REPO / "scripts" / "measure"), config=str(workload.config), output=str(folder),
                                   layers=layers, seed=0)
    subprocess.run([sys.executable, "-c", snippet], check=True, cwd=REPO)
    print(f"built {folder} in {time.perf_counter() - started:.0f} s", flush=True)
    return folder

