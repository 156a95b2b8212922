#!/usr/bin/env python
"""Benchmark the recipes' strategies on a GPU box: wall time, tokens/s per GPU, MFU, GPU utilisation, memory.

Each strategy is the real recipe through `accelerate launch --config_file accelerate_configs/<config>.yaml
--num_processes <GPUs>` (model parallel: 1 process that spreads the layers over the GPUs), on one epoch of
locally generated data, with the reference workloads of ../shared/notes/performance.md:

  tinyllama     TinyLlama-1.1B shape + LoRA, 1024 rows x 1024 tokens, --batch-size 16 --grad-accum 2;
                strategies model_parallel, ddp, zero2, zero3, qlora_ddp (recipes/qlora.py under ddp.yaml)
  codellama34b  CodeLlama-34B shape + LoRA, 1024 rows x 1024 tokens, --batch-size 4 --grad-accum 4;
                strategies model_parallel, fsdp, zero3; --layers N builds fewer layers when the GPUs (or
                the disk: 63 GiB of bf16 weights) cannot hold all 48

Everything is offline. Models are built from data/model_configs/*.json with random weights (speed does
not depend on their values) as bf16 safetensors, with the bundled tokenizer (data/tokenizer) beside
them, into --model-cache (default results/models/<name>-<layers>L), and reused when present. The data
is 1024 rows of random words, each checked with the tokenizer to be cut by --max-length to exactly that
many tokens (a `text` column: every token but the BOS is a target), in <output-dir>/data/.

What is reported per strategy (results.md, results.json and chart.png in
<output-dir>/<YYYY-MM-DD>_<device>_torch<ver>_transformers<ver>/; each launch's own files are in runs/):

- wall time: the training loop, model loading and compile warm-up apart. metrics.jsonl's clock starts
  after the model is loaded; wall = last step's elapsed_s - first step's elapsed_s + the median step
  duration, i.e. the first step (which includes warm-up / compilation) is replaced by the median step.
- tokens/s per GPU: real tokens (metrics.jsonl's `tokens`, the target tokens of the `text` format, i.e.
  every token but one BOS per row) / wall / GPUs.
- MFU = tokens/s x FLOP/token / (GPUs x peak). LoRA: FLOP/token = 4N + 12 L h s (N: the parameters of
  every matmul, lm_head included, embeddings excluded; L layers, h hidden, s sequence length); with
  --gradient-checkpointing the work done is 6N + 16 L h s, reported separately as "utilisation"
  (recompute included; equal to MFU without checkpointing).
- peak: dense bf16 TFLOP/s per GPU from a table matched on the GPU's name (H100 SXM 989, H100 NVL 835,
  H100 PCIe 756, H200 989, A100 312, RTX 6000 Ada 364, L40S 362), or --peak-tflops, or measured with
  --measure-peak (a large bf16 matmul; used when the GPU is not in the table, otherwise reported beside).
- GPU util: NVML utilisation of the GPUs (pynvml / nvidia-ml-py, else `nvidia-smi`, else n/a),
  sampled every 0.5 s during the launch and averaged over the training steps. NVML counts
  communication kernels as busy: a secondary figure.
- peak memory: the maximum over metrics.jsonl of peak_allocated_gib / peak_reserved_gib (rank 0 / the
  first GPU).

--smoke runs the same path on CPU (2 processes, fp32) with the bundled tiny model, 64 rows x 64 tokens,
strategies ddp,zero2 by default, in well under a minute per strategy. Its peak is a nominal CPU figure
(CPU_NOMINAL_PEAK_TFLOPS per process: one core, 2 AVX2 FMA units x 8 fp32 lanes x 2 FLOP x ~3 GHz),
not a measurement: it only exercises the MFU arithmetic.

Examples:
  python scripts/benchmark.py --workload tinyllama
  python scripts/benchmark.py --workload codellama34b --layers 12 --strategies model_parallel,fsdp
  python scripts/benchmark.py --smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))  # recipes/common: the recipes' own model-shape arithmetic

from common.memory import ModelShape  # noqa: E402  (pure Python: no torch)

TOKENIZER_DIR = REPO / "data" / "tokenizer"
TINY_MODEL = REPO / "models" / "tiny-llama"
TINY_CONFIG = REPO / "data" / "tiny-llama-config.json"
CONFIGS = REPO / "accelerate_configs"

# Nominal peak of one CPU process (one core, fp32): 2 FMA units x 8 lanes x 2 FLOP x ~3 GHz ~ 0.1 TFLOP/s.
# A round figure, not a measurement; only the smoke run uses it.
CPU_NOMINAL_PEAK_TFLOPS = 0.1

# Dense bf16 tensor-core peak per GPU, TFLOP/s (no sparsity). Matched in order on the lower-cased
# torch.cuda.get_device_name(): the first entry whose words all occur in it wins.
PEAK_TFLOPS = (
    (("h100", "nvl"), 835.0, "H100 NVL"),
    (("h100", "pcie"), 756.0, "H100 PCIe"),
    (("h100",), 989.0, "H100 SXM"),
    (("h200",), 989.0, "H200"),
    (("gh200",), 989.0, "GH200"),
    (("a100",), 312.0, "A100"),
    (("rtx 6000 ada",), 364.0, "RTX 6000 Ada"),
    (("l40s",), 362.0, "L40S"),
)


@dataclass(frozen=True)
class Strategy:
    name: str
    config: str  # file in accelerate_configs/
    recipe: str  # file in recipes/
    label: str


STRATEGIES = {
    "model_parallel": Strategy("model_parallel", "model_parallel", "lora", "model parallel"),
    "ddp": Strategy("ddp", "ddp", "lora", "DDP"),
    "fsdp": Strategy("fsdp", "fsdp", "lora", "FSDP"),
    "zero2": Strategy("zero2", "zero2", "lora", "ZeRO-2"),
    "zero3": Strategy("zero3", "zero3", "lora", "ZeRO-3"),
    "qlora_ddp": Strategy("qlora_ddp", "ddp", "qlora", "DDP + QLoRA (4-bit base)"),
}


@dataclass(frozen=True)
class Workload:
    name: str
    label: str
    config: Path | None  # data/model_configs/*.json; None: the bundled tiny model
    rows: int
    max_length: int
    batch_size: int
    grad_accum: int
    strategies: tuple


WORKLOADS = {
    "tinyllama": Workload("tinyllama", "TinyLlama-1.1B + LoRA, 1024 rows x 1024 tokens, batch 16, GA 2",
                          REPO / "data" / "model_configs" / "tinyllama-1.1b.json", 1024, 1024, 16, 2,
                          ("model_parallel", "ddp", "zero2", "zero3", "qlora_ddp")),
    "codellama34b": Workload("codellama34b", "CodeLlama-34B + LoRA, 1024 rows x 1024 tokens, batch 4, GA 4",
                             REPO / "data" / "model_configs" / "codellama-34b.json", 1024, 1024, 4, 4,
                             ("model_parallel", "fsdp", "zero3")),
    "smoke": Workload("smoke", "smoke (CPU): tiny-llama + LoRA, 64 rows x 64 tokens, batch 2, GA 2",
                      None, 64, 64, 2, 2, ("ddp", "zero2")),
}

# ../shared/notes/performance.md: 4x RTX 6000 Ada 48 GB (PCIe, no NVLink). LoRA rank / targets, data,
# precision and padding were not published; the MFU below assumes 1,048,576 real tokens and bf16 peak.
REFERENCE_HARDWARE = "4x RTX 6000 Ada 48 GB, PCIe"
REFERENCE_GPUS = 4
REFERENCE_PEAK_TFLOPS = 364.0
REFERENCE = (
    {"workload": "tinyllama", "strategy": "model_parallel", "wall_s": 233.0, "wall": "3 min 53 s", "gpu_util": "24%"},
    {"workload": "tinyllama", "strategy": "ddp", "wall_s": 59.0, "wall": "59 s", "gpu_util": "90%"},
    {"workload": "codellama34b", "strategy": "model_parallel", "wall_s": 47 * 60.0, "wall": "47 min",
     "gpu_util": "~20%"},
    {"workload": "codellama34b", "strategy": "fsdp", "wall_s": 30 * 60.0, "wall": "30 min", "gpu_util": "~100%"},
)
REFERENCE_TOKENS = 1024 * 1024

WALL_RULE = ("training loop only, model loading and compile warm-up apart: last step's elapsed_s - first "
             "step's elapsed_s + median step (the first step, which includes warm-up/compile, is replaced "
             "by the median step)")


# --------------------------------------------------------------------------------------------
# Arithmetic: FLOP per token, the wall-time rule, the peak
# --------------------------------------------------------------------------------------------

def matmul_parameters(shape: ModelShape) -> int:
    """N: parameters that take part in a matmul per token: every block linear and the lm_head (it
    multiplies even when tied to the embedding); the embedding lookup and the norms are excluded."""
    return shape.parameter_counts()["linear"] + shape.vocab * shape.hidden


def flop_per_token(shape: ModelShape, seq_len: int, method: str = "lora", recompute: bool = False) -> float:
    """Training FLOP per token (performance.md). A = layers x hidden x seq_len (attention scores and
    values: 4 A forward, 8 A backward).

    - LoRA / QLoRA: 4N + 12A (forward 2N, backward input gradients 2N; the frozen base gets no weight
      gradients); with activation recompute 6N + 16A (one more forward).
    - full fine-tuning: 6N + 12A; with recompute 8N + 16A.
    The adapters' own matmuls (< 1% at r=16) are left out.
    """
    n = matmul_parameters(shape)
    a = shape.layers * shape.hidden * seq_len
    base = 6 * n if method == "full" else 4 * n
    if recompute:
        return base + 2 * n + 16 * a
    return base + 12 * a


def training_wall_time(elapsed: list[float]) -> dict:
    """The training loop's wall time from the steps' `elapsed_s` (in step order).

    wall = elapsed[-1] - elapsed[0] + median step, where the step durations are elapsed[i] - elapsed[i-1]
    for the steps after the first: the first step (clock start -> first step end: warm-up, compile,
    allocator growth) is replaced by the median of the others. With a single step nothing can replace
    it: wall = its elapsed_s (rule "single step, warm-up included").
    """
    if not elapsed:
        raise ValueError("no training steps in metrics.jsonl")
    if len(elapsed) == 1:
        return {"wall_s": float(elapsed[0]), "median_step_s": float(elapsed[0]), "first_step_s": float(elapsed[0]),
                "steps": 1, "rule": "single step, warm-up included"}
    durations = [later - earlier for earlier, later in zip(elapsed, elapsed[1:])]
    median = statistics.median(durations)
    return {"wall_s": float(elapsed[-1] - elapsed[0] + median), "median_step_s": float(median),
            "first_step_s": float(elapsed[0]), "steps": len(elapsed), "rule": "first step replaced by the median"}


def steady_state(lines: list[dict], warmup_steps: int) -> dict:
    """Step time and tokens/s from metrics.jsonl's train lines, the first `warmup_steps` steps left out.

    The steady part runs from the end of step `warmup_steps` (0: from the end of step 1's predecessor,
    i.e. the clock's first reading is step 1's end) to the end of the last step; its tokens are those
    of the steps that end inside it. `epoch_s` is the mean steady step times every step of the run.
    """
    train = sorted((line for line in lines if line.get("type") == "train"), key=lambda line: line["step"])
    if len(train) < warmup_steps + 2:
        raise ValueError(f"{len(train)} steps: too few to leave {warmup_steps} warm-up steps out")
    steady_steps = len(train) - warmup_steps - 1
    seconds = train[-1]["elapsed_s"] - train[warmup_steps]["elapsed_s"]
    tokens = sum(line["tokens"] for line in train[warmup_steps + 1:])
    peaks = [line["peak_allocated_gib"] for line in train if line.get("peak_allocated_gib") is not None]
    return {"steps": len(train), "steady_s": seconds, "steady_tokens": tokens, "step_s": seconds / steady_steps,
            "epoch_s": seconds / steady_steps * len(train),
            "tokens_per_s": tokens / seconds if seconds > 0 else float("inf"),
            "epoch_tokens": sum(line["tokens"] for line in train),
            "peak_allocated_gib": max(peaks) if peaks else None, "final_loss": train[-1].get("loss")}


def mfu(tokens_per_s_per_gpu: float, flop: float, peak_flops_per_gpu: float) -> float:
    """tokens/s x FLOP/token / (GPUs x peak), with tokens/s already per GPU."""
    return tokens_per_s_per_gpu * flop / peak_flops_per_gpu


def table_peak(device_name: str) -> tuple[float, str] | None:
    """(dense bf16 TFLOP/s, matched entry) for a GPU name, or None when it is not in the table."""
    name = device_name.lower()
    for words, tflops, label in PEAK_TFLOPS:
        if all(word in name for word in words):
            return tflops, label
    return None


def summarise_metrics(lines: list[dict]) -> dict:
    """Steps, tokens, wall time and peak memory from metrics.jsonl's records."""
    train = sorted((line for line in lines if line.get("type") == "train"), key=lambda line: line["step"])
    if not train:
        raise ValueError("metrics.jsonl has no training step")
    summary = training_wall_time([line["elapsed_s"] for line in train])
    summary["tokens"] = int(sum(line["tokens"] for line in train))
    for key in ("peak_allocated_gib", "peak_reserved_gib"):
        values = [line[key] for line in train if line.get(key) is not None]
        summary[key] = max(values) if values else None
    summary["final_loss"] = train[-1]["loss"]
    return summary


def format_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def percent(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value * 100:.2f}%" if value < 0.01 else f"{value * 100:.1f}%"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


# --------------------------------------------------------------------------------------------
# Model and data
# --------------------------------------------------------------------------------------------

BUILD_SNIPPET = """
import sys
sys.path.insert(0, {scripts!r})
import benchmark
benchmark.build_random_model({config!r}, {output!r}, layers={layers!r}, seed={seed!r})
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


def shape_of(config_path: Path, layers: int | None = None) -> ModelShape:
    raw = json.loads(Path(config_path).read_text())
    if layers:
        raw["num_hidden_layers"] = int(layers)
    return ModelShape.from_config(raw, name=Path(config_path).stem)


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
    snippet = BUILD_SNIPPET.format(scripts=str(REPO / "scripts"), config=str(workload.config), output=str(folder),
                                   layers=layers, seed=0)
    subprocess.run([sys.executable, "-c", snippet], check=True, cwd=REPO)
    print(f"built {folder} in {time.perf_counter() - started:.0f} s", flush=True)
    return folder


WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega matrix vector tensor kernel "
         "shard gather reduce scatter gradient adapter layer token batch epoch memory device stream cache "
         "model train loss step rank node queue table graph value index").split()


def random_text(rng: random.Random, chars: int) -> str:
    words = []
    length = 0
    while length < chars:
        word = rng.choice(WORDS) if rng.random() < 0.8 else str(rng.randrange(10**6))
        words.append(word)
        length += len(word) + 1
    return " ".join(words)


def ensure_data(folder: Path, rows: int, length: int, eval_rows: int = 16, seed: int = 0) -> Path:
    """`folder`/train.jsonl: `rows` rows of a `text` column, each cut by --max-length `length` to exactly
    `length` tokens (BOS + `length - 1` targets), checked with the bundled tokenizer and the recipes'
    own tokenisation; eval.jsonl: `eval_rows` short rows, so that the recipe trains on all `rows` rows
    (it holds 5% out only when there is no evaluation split) and its end-of-run evaluation is cheap."""
    meta = {"rows": rows, "max_length": length, "eval_rows": eval_rows, "seed": seed, "format": "text"}
    if (folder / "meta.json").exists() and json.loads((folder / "meta.json").read_text()) == meta:
        return folder
    from transformers import AutoTokenizer

    from common.formats import tokenize_row

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    rng = random.Random(seed)

    def row_of(tokens: int) -> str:
        text = random_text(rng, int(tokens * 1.2) + 16)
        while len(tokenizer(text, add_special_tokens=False)["input_ids"]) < tokens:
            text += " " + random_text(rng, tokens // 4 + 16)
        return text

    train = [row_of(length) for _ in range(rows)]
    for text in train:
        tokens = tokenize_row({"text": text}, tokenizer, "text", length)
        targets = sum(label != -100 for label in tokens["labels"][1:])
        if len(tokens["input_ids"]) != length or targets != length - 1:
            raise RuntimeError(f"a generated row tokenises to {len(tokens['input_ids'])} tokens, not {length}")
    short = max(8, min(32, length // 4))
    evaluation = [random_text(rng, short) for _ in range(eval_rows)]
    folder.mkdir(parents=True, exist_ok=True)
    for name, texts in (("train.jsonl", train), ("eval.jsonl", evaluation)):
        with open(folder / name, "w") as file:
            for text in texts:
                file.write(json.dumps({"text": text}) + "\n")
    (folder / "meta.json").write_text(json.dumps(meta) + "\n")
    return folder


# --------------------------------------------------------------------------------------------
# The devices: probed in a child process, so this one never holds a CUDA context
# --------------------------------------------------------------------------------------------

PROBE_SNIPPET = r"""
import json, time, torch
measure = MEASURE
info = {"cuda": torch.cuda.is_available(), "count": torch.cuda.device_count() if torch.cuda.is_available() else 0}
if info["cuda"]:
    info["names"] = [torch.cuda.get_device_name(i) for i in range(info["count"])]
    info["memory_gib"] = [round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1) for i in range(info["count"])]
if measure:
    if info["cuda"]:
        n, dtype, device = 8192, torch.bfloat16, "cuda"
    else:
        n, dtype, device = 1024, torch.float32, "cpu"
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    best = 0.0
    for repeat in range(4):
        iterations = 50 if info["cuda"] else 5
        if info["cuda"]:
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(iterations):
            c = a @ b
        if info["cuda"]:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        if repeat:  # the first round warms up
            best = max(best, 2 * n**3 * iterations / elapsed)
    info["measured_tflops"] = best / 1e12
    info["measured_with"] = f"{n}x{n} {str(dtype).replace('torch.', '')} matmul on {device}"
print("PROBE " + json.dumps(info))
"""


def probe_devices(measure: bool, env: dict) -> dict:
    code = PROBE_SNIPPET.replace("MEASURE", "True" if measure else "False")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    for line in done.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[len("PROBE "):])
    raise RuntimeError(f"the device probe failed:\n{done.stdout}\n{done.stderr}")


# --------------------------------------------------------------------------------------------
# GPU utilisation (NVML) and the training window, sampled while a launch runs
# --------------------------------------------------------------------------------------------

def nvml_indices(count: int) -> list[str]:
    """NVML ids (indices or UUIDs) of the GPUs the launches see (CUDA_VISIBLE_DEVICES, else all)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip() == "":
        return [str(i) for i in range(count)]
    return [item.strip() for item in visible.split(",") if item.strip()][:count]


class GpuSampler:
    """Reads each visible GPU's utilisation (%) and memory in use, via pynvml, else nvidia-smi."""

    def __init__(self, ids: list[str]):
        self.ids = ids
        self.kind = None
        self.handles = []
        if not ids:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            for gpu in ids:
                if gpu.isdigit():
                    self.handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(gpu)))
                else:
                    self.handles.append(pynvml.nvmlDeviceGetHandleByUUID(gpu))
            self.nvml = pynvml
            self.kind = "pynvml"
            return
        except Exception:  # not installed, no driver, MIG ids, ...
            self.handles = []
        if shutil.which("nvidia-smi") and self._smi() is not None:
            self.kind = "nvidia-smi"

    def _smi(self):
        try:
            done = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                                   "--format=csv,noheader,nounits", "-i", ",".join(self.ids)],
                                  capture_output=True, text=True, timeout=5)
            rows = [line.split(",") for line in done.stdout.strip().splitlines()]
            return [(float(util), float(used) / 1024) for util, used in rows]
        except Exception:
            return None

    def sample(self):
        """[(util %, used GiB)] per GPU, or None."""
        if self.kind == "pynvml":
            try:
                return [(float(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu),
                         self.nvml.nvmlDeviceGetMemoryInfo(h).used / 2**30) for h in self.handles]
            except Exception:
                return None
        if self.kind == "nvidia-smi":
            return self._smi()
        return None


class LaunchMonitor(threading.Thread):
    """Every `interval` s: one GPU sample, and the time each new training step appears in metrics.jsonl."""

    def __init__(self, sampler: GpuSampler | None, metrics_path: Path, interval: float = 0.5):
        super().__init__(daemon=True)
        self.sampler, self.metrics_path, self.interval = sampler, metrics_path, interval
        self.samples = []  # (time, [(util, used GiB)])
        self.step_seen = {}  # step -> time its line was first read
        self.stopped = threading.Event()
        self._offset = 0
        self._partial = ""

    def _read_steps(self, now: float) -> None:
        try:
            with open(self.metrics_path) as file:
                file.seek(self._offset)
                chunk = file.read()
                self._offset = file.tell()
        except OSError:
            return
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("type") == "train":
                self.step_seen.setdefault(record["step"], now)

    def run(self) -> None:
        while not self.stopped.is_set():
            now = time.monotonic()
            if self.sampler is not None and self.sampler.kind:
                values = self.sampler.sample()
                if values:
                    self.samples.append((now, values))
            self._read_steps(now)
            self.stopped.wait(self.interval)
        self._read_steps(time.monotonic())

    def stop(self) -> None:
        self.stopped.set()
        self.join()

    def training_utilisation(self, wall_s: float) -> dict:
        """Mean GPU utilisation over the training steps: from the first step's line to the last's (both
        as seen here, +-0.5 s), i.e. the steady steps; with a single step, the wall time before it."""
        if not self.samples:
            return {"gpu_util": None, "gpu_util_per_gpu": None, "gpu_used_gib_max": None, "util_samples": 0}
        seen = sorted(self.step_seen.values())
        if len(seen) >= 2 and seen[-1] - seen[0] >= self.interval:
            start, end = seen[0], seen[-1]
        elif seen:
            start, end = seen[-1] - wall_s, seen[-1]
        else:
            start, end = self.samples[0][0], self.samples[-1][0]
        window = [values for at, values in self.samples if start <= at <= end] or [self.samples[-1][1]]
        per_gpu = [statistics.fmean(values[i][0] for values in window) / 100 for i in range(len(window[0]))]
        used = max(value[1] for _, values in self.samples for value in values)
        return {"gpu_util": statistics.fmean(per_gpu), "gpu_util_per_gpu": [round(u, 3) for u in per_gpu],
                "gpu_used_gib_max": round(used, 2), "util_samples": len(window)}


# --------------------------------------------------------------------------------------------
# One strategy: the launch and its numbers
# --------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(strategy: Strategy, processes: int, model: Path, data: Path, output: Path, workload: Workload,
                   batch_size: int, grad_accum: int, smoke: bool, gradient_checkpointing: bool,
                   port: int | None = None, python: str = sys.executable, recipe_args: tuple = ()) -> list[str]:
    command = [python, "-m", "accelerate.commands.launch", "--config_file",
               str(CONFIGS / f"{strategy.config}.yaml"), "--num_processes", str(processes)]
    if port is not None and processes > 1:
        command += ["--main_process_port", str(port)]
    if smoke:
        command += ["--mixed_precision", "no"]
    command += [str(REPO / "recipes" / f"{strategy.recipe}.py"), "--model", str(model), "--dataset", str(data),
                "--output-dir", str(output), "--epochs", "1", "--max-length", str(workload.max_length),
                "--batch-size", str(batch_size), "--grad-accum", str(grad_accum),
                "--report-to", "none", "--log-every", "0", "--eval-every", "0"]
    if gradient_checkpointing:
        command.append("--gradient-checkpointing")
    return command + list(recipe_args)


def shell_line(command: list[str]) -> str:
    """The command as a person would type it: `accelerate launch ...`, paths relative to the repository."""
    words = list(command)
    if words[:3] == [sys.executable, "-m", "accelerate.commands.launch"]:
        words = ["accelerate", "launch"] + words[3:]
    out = []
    for word in words:
        try:
            word = str(Path(word).relative_to(REPO)) if word.startswith(str(REPO)) else word
        except ValueError:
            pass
        out.append(word)
    return " ".join(out)


def run_strategy(strategy: Strategy, settings: dict, env: dict, sampler_ids: list[str], log) -> dict:
    """Launch one strategy, wait, and turn its metrics.jsonl into a row of results.json."""
    output = settings["runs"] / settings["workload"].name / strategy.name
    if output.exists():
        shutil.rmtree(output)  # a fresh run: no stale metrics, and the recipe refuses foreign checkpoints
    output.mkdir(parents=True)
    processes = 1 if strategy.name == "model_parallel" else settings["devices"]
    # Model parallel spreads one process over every GPU; on CPU (smoke) it is one process on one core.
    devices = processes if settings["smoke"] else settings["devices"]
    command = launch_command(strategy, processes, settings["model"], settings["data"], output,
                             settings["workload"], settings["batch_size"], settings["grad_accum"],
                             settings["smoke"], settings["gradient_checkpointing"], port=free_port(),
                             recipe_args=settings["recipe_args"])
    row = {
        "workload": settings["workload"].name, "workload_label": settings["workload"].label,
        "strategy": strategy.name, "strategy_label": strategy.label, "config": f"accelerate_configs/{strategy.config}.yaml",
        "recipe": f"recipes/{strategy.recipe}.py", "processes": processes, "gpus": devices,
        "device": settings["device_label"], "layers": settings["layers"], "full_layers": settings["full_layers"],
        "batch_size": settings["batch_size"], "grad_accum": settings["grad_accum"],
        "max_length": settings["workload"].max_length, "gradient_checkpointing": settings["gradient_checkpointing"],
        "command": shell_line(command), "output_dir": str(output),
    }
    log(f"[{strategy.name}] {row['command']}")
    sampler = GpuSampler(sampler_ids) if sampler_ids else None
    monitor = LaunchMonitor(sampler, output / "metrics.jsonl")
    monitor.start()
    started = time.perf_counter()
    with open(output / "launch.log", "w") as log_file:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            returncode = process.wait(timeout=settings["timeout"] or None)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            returncode = "timeout"
    row["launch_s"] = round(time.perf_counter() - started, 3)
    monitor.stop()
    if returncode != 0:
        tail = (output / "launch.log").read_text(errors="replace").strip().splitlines()[-15:]
        reason = next((line for line in reversed(tail) if "error" in line.lower() or "memory" in line.lower()),
                      tail[-1] if tail else "no output")
        row.update(status="failed", error=f"exit {returncode}: {reason.strip()[:300]}")
        log(f"[{strategy.name}] FAILED ({row['error']}); log: {output / 'launch.log'}")
        return row
    lines = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = summarise_metrics(lines)
    shape = settings["shape"]
    method = "qlora" if strategy.recipe == "qlora" else "lora"
    flop = flop_per_token(shape, settings["workload"].max_length, method)
    flop_done = flop_per_token(shape, settings["workload"].max_length, method,
                               recompute=settings["gradient_checkpointing"])
    per_gpu = summary["tokens"] / summary["wall_s"] / devices
    peak = settings["peak_tflops"] * 1e12
    row.update(
        status="ok", steps=summary["steps"], tokens=summary["tokens"], wall_s=round(summary["wall_s"], 3),
        wall_rule=summary["rule"], median_step_s=round(summary["median_step_s"], 4),
        first_step_s=round(summary["first_step_s"], 3), tokens_per_s_per_gpu=round(per_gpu, 1),
        flop_per_token=flop, flop_per_token_with_recompute=flop_done, peak_tflops_per_gpu=settings["peak_tflops"],
        mfu=mfu(per_gpu, flop, peak), utilisation=mfu(per_gpu, flop_done, peak),
        peak_allocated_gib=summary["peak_allocated_gib"], peak_reserved_gib=summary["peak_reserved_gib"],
        final_loss=summary["final_loss"],
    )
    row.update(monitor.training_utilisation(summary["wall_s"]))
    row["gpu_util_source"] = sampler.kind if sampler is not None and sampler.kind else None
    if settings["layers"] != settings["full_layers"]:
        # Scaled per layer by the FLOP per token of the whole model: assumes the measured MFU holds.
        full = shape_of(settings["workload"].config, settings["full_layers"])
        ratio = flop_per_token(full, settings["workload"].max_length, method) / flop
        row["scaled_estimate"] = {
            "layers": settings["full_layers"], "factor": ratio, "wall_s": round(row["wall_s"] * ratio, 1),
            "tokens_per_s_per_gpu": round(per_gpu / ratio, 1),
            "method": (f"estimate, not measured: the {settings['layers']}-layer wall time x FLOP/token of "
                       f"{settings['full_layers']} layers / FLOP/token of {settings['layers']} layers "
                       f"(x{ratio:.2f}); assumes the measured MFU holds for the full depth"),
        }
    log(f"[{strategy.name}] wall {format_duration(row['wall_s'])} ({row['steps']} steps), "
        f"{per_gpu:,.0f} tokens/s/GPU, MFU {percent(row['mfu'])}, GPU util {percent(row['gpu_util'])}, "
        f"launch {format_duration(row['launch_s'])}")
    return row


# --------------------------------------------------------------------------------------------
# Results: markdown table, JSON, chart
# --------------------------------------------------------------------------------------------

def reference_rows() -> list[dict]:
    rows = []
    for ref in REFERENCE:
        workload = WORKLOADS[ref["workload"]]
        shape = shape_of(workload.config)
        flop = flop_per_token(shape, workload.max_length)
        per_gpu = REFERENCE_TOKENS / ref["wall_s"] / REFERENCE_GPUS
        rows.append({**ref, "workload_label": workload.label, "strategy_label": STRATEGIES[ref["strategy"]].label,
                     "gpus": REFERENCE_GPUS, "device": REFERENCE_HARDWARE,
                     "tokens_per_s_per_gpu": round(per_gpu, 1),
                     "mfu": mfu(per_gpu, flop, REFERENCE_PEAK_TFLOPS * 1e12)})
    return rows


def find_reference(workload: str, strategy: str) -> dict | None:
    return next((ref for ref in reference_rows() if ref["workload"] == workload and ref["strategy"] == strategy), None)


def memory_cell(row: dict) -> str:
    if row.get("peak_allocated_gib") is None:
        return "n/a"
    return f"{row['peak_allocated_gib']:.1f} / {row['peak_reserved_gib']:.1f}"


def markdown_table(rows: list[dict]) -> str:
    header = ("| workload | strategy | source | GPUs | wall time | tokens/s/GPU | MFU | utilisation (recompute incl.) "
              "| GPU util (NVML) | peak mem alloc / reserved (GiB) | reference wall time | vs reference |")
    lines = [header, "|" + "---|" * 12]
    order = {name: i for i, name in enumerate(WORKLOADS)}
    strategy_order = {name: i for i, name in enumerate(STRATEGIES)}
    ours = sorted(rows, key=lambda r: (order.get(r["workload"], 99), strategy_order.get(r["strategy"], 99)))
    for workload in sorted({r["workload"] for r in ours} | {r["workload"] for r in REFERENCE},
                           key=lambda name: order.get(name, 99)):
        references = [ref for ref in reference_rows() if ref["workload"] == workload]
        mine = [row for row in ours if row["workload"] == workload]
        strategies = sorted({r["strategy"] for r in references + mine}, key=lambda s: strategy_order.get(s, 99))
        for strategy in strategies:
            for ref in (r for r in references if r["strategy"] == strategy):
                lines.append(
                    f"| {ref['workload_label']} | {ref['strategy_label']} | reference ({ref['device']}) | "
                    f"{ref['gpus']} | {ref['wall']} | {ref['tokens_per_s_per_gpu']:,.0f} | {percent(ref['mfu'])}* | — "
                    f"| {ref['gpu_util']} | — | — | — |")
            for row in (r for r in mine if r["strategy"] == strategy):
                layers = "" if row["layers"] == row["full_layers"] else f", {row['layers']} of {row['full_layers']} layers"
                source = f"ours ({row['device']}{layers})"
                ref = find_reference(row["workload"], row["strategy"])
                if row.get("status") != "ok":
                    lines.append(f"| {row['workload_label']} | {row['strategy_label']} | {source} | {row['gpus']} | "
                                 f"failed: {row.get('error', '')[:120].replace('|', '/')} | | | | | | "
                                 f"{ref['wall'] if ref else '—'} | |")
                    continue
                versus = f"{ref['wall_s'] / row['wall_s']:.2f}x faster" if ref else "—"
                if ref and row["layers"] != row["full_layers"]:
                    versus = f"not comparable ({row['layers']} of {row['full_layers']} layers)"
                lines.append(
                    f"| {row['workload_label']} | {row['strategy_label']} | {source} | {row['gpus']} | "
                    f"{format_duration(row['wall_s'])} | {row['tokens_per_s_per_gpu']:,.0f} | {percent(row['mfu'])} | "
                    f"{percent(row['utilisation'])} | {percent(row.get('gpu_util'))} | {memory_cell(row)} | "
                    f"{ref['wall'] if ref else '—'} | {versus} |")
                estimate = row.get("scaled_estimate")
                if estimate:
                    versus = f"{ref['wall_s'] / estimate['wall_s']:.2f}x faster" if ref else "—"
                    lines.append(
                        f"| {row['workload_label']} | {row['strategy_label']} | ESTIMATE for {estimate['layers']} "
                        f"layers, scaled from the {row['layers']}-layer run (not measured) | {row['gpus']} | "
                        f"~{format_duration(estimate['wall_s'])} | ~{estimate['tokens_per_s_per_gpu']:,.0f} | "
                        f"(as measured) | | | | {ref['wall'] if ref else '—'} | {versus} (estimate) |")
    return "\n".join(lines)


def notes(environment: dict, rows: list[dict]) -> list[str]:
    out = [
        f"Wall time: {WALL_RULE}.",
        "tokens/s/GPU: real tokens (metrics.jsonl `tokens`: every token but one BOS per row for the `text` "
        "data) / wall time / GPUs. Model parallel counts all the GPUs it spreads over.",
        "MFU = tokens/s x FLOP/token / (GPUs x peak), FLOP/token = 4N + 12·L·h·s for LoRA (N: matmul parameters "
        "incl. lm_head, excl. embeddings). Utilisation (recompute incl.) uses 6N + 16·L·h·s when the run used "
        "--gradient-checkpointing and equals MFU otherwise.",
        f"Peak: {environment['peak_tflops']:g} TFLOP/s per device; source: {environment['peak_source']}.",
        "GPU util: NVML utilisation averaged over the GPUs and over the training steps (sampled every 0.5 s); "
        "NVML counts communication kernels as busy, so it is a secondary figure. n/a: no NVML (CPU, or neither "
        "pynvml / nvidia-ml-py nor nvidia-smi available).",
        "Peak memory: the maximum of metrics.jsonl's peak_allocated_gib / peak_reserved_gib, i.e. rank 0 "
        "(model parallel: the first GPU).",
        f"* Reference MFU: computed here from the published time, assuming {REFERENCE_TOKENS:,} real tokens per "
        f"epoch and {REFERENCE_PEAK_TFLOPS:g} TFLOP/s dense bf16 per RTX 6000 Ada; the reference did not publish "
        "LoRA rank / targets, data, precision or padding.",
    ]
    if environment["devices"] > 1 and any(row["strategy"] == "model_parallel" for row in rows):
        out.append(f"Global batch: the recipe flags are per process (as in the reference), so model parallel "
                   f"(1 process) takes {environment['devices']}x more, {environment['devices']}x smaller optimizer "
                   f"steps than the data-parallel strategies on {environment['devices']} devices over the same epoch.")
    if environment.get("measured_tflops"):
        out.append(f"Measured: {environment['measured_tflops']:.0f} TFLOP/s ({environment['measured_with']}).")
    if any(row.get("scaled_estimate") for row in rows):
        out.append("Rows marked ESTIMATE are not measurements: " + next(
            row["scaled_estimate"]["method"] for row in rows if row.get("scaled_estimate")) + ".")
    return out


def write_chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [name for name in WORKLOADS if any(row["workload"] == name for row in rows)]
    figure, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    for axis, workload in zip(axes[0], workloads):
        mine = [row for row in rows if row["workload"] == workload]
        references = [ref for ref in reference_rows() if ref["workload"] == workload]
        strategies = [name for name in STRATEGIES if any(r["strategy"] == name for r in mine + references)]
        ours_label = f"ours ({mine[0]['device']}, measured)" if mine else "ours (measured)"
        reduced = next((row for row in mine if row["layers"] != row["full_layers"]), None)
        if reduced:
            ours_label = f"ours ({mine[0]['device']}, {reduced['layers']} of {reduced['full_layers']} layers, measured)"
        series = [(ours_label, "#1f77b4", "", lambda s: next(
                      (r["wall_s"] for r in mine if r["strategy"] == s and r.get("status") == "ok"), None))]
        if any(row.get("scaled_estimate") for row in mine):
            series.append((f"ours, scaled per layer to {mine[0]['full_layers']} layers "
                           "(estimate, not measured)", "#aec7e8", "//", lambda s: next(
                (r["scaled_estimate"]["wall_s"] for r in mine if r["strategy"] == s and r.get("scaled_estimate")),
                None)))
        if references:
            series.append((f"reference ({REFERENCE_HARDWARE})", "#ff7f0e", "", lambda s: next(
                (r["wall_s"] for r in references if r["strategy"] == s), None)))
        width = 0.8 / len(series)
        for i, (label, colour, hatch, value_of) in enumerate(series):
            xs, heights = [], []
            for j, strategy in enumerate(strategies):
                value = value_of(strategy)
                if value is not None:
                    xs.append(j + (i - (len(series) - 1) / 2) * width)
                    heights.append(value)
            bars = axis.bar(xs, heights, width, label=label, color=colour, hatch=hatch, edgecolor="black",
                            linewidth=0.5)
            axis.bar_label(bars, labels=[format_duration(h) for h in heights], fontsize=7, padding=2)
        for j, strategy in enumerate(strategies):
            if any(r["strategy"] == strategy and r.get("status") != "ok" for r in mine):
                axis.annotate("ours: failed", (j, 0), textcoords="offset points", xytext=(0, 4), ha="center",
                              fontsize=7, color="red")
        axis.set_xticks(range(len(strategies)), [STRATEGIES[s].label for s in strategies], rotation=15, fontsize=8)
        axis.set_ylabel("training-loop wall time (s)")
        axis.set_title(WORKLOADS[workload].label, fontsize=9)
        axis.legend(fontsize=7)
        axis.margins(y=0.15)
    figure.suptitle("One epoch, model loading and compile warm-up apart", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_results(folder: Path, environment: dict, new_rows: list[dict]) -> list[dict]:
    """results.json / results.md / chart.png; rows of other workloads or strategies already in
    results.json (an earlier run on the same day, device and versions) are kept, same ones replaced."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    previous = folder / "results.json"
    if previous.exists():
        try:
            rows = json.loads(previous.read_text()).get("rows", [])
        except ValueError:
            rows = []
    replaced = {(row["workload"], row["strategy"]) for row in new_rows}
    rows = [row for row in rows if (row["workload"], row["strategy"]) not in replaced] + new_rows
    document = {"environment": environment, "wall_rule": WALL_RULE, "reference": reference_rows(), "rows": rows,
                "notes": notes(environment, rows)}
    previous.write_text(json.dumps(document, indent=2, default=str) + "\n")
    table = markdown_table(rows)
    md = [f"# Benchmark: {environment['device_label']}", "",
          f"{environment['date']}, torch {environment['versions'].get('torch')}, transformers "
          f"{environment['versions'].get('transformers')}, accelerate {environment['versions'].get('accelerate')}, "
          f"peft {environment['versions'].get('peft')}, deepspeed {environment['versions'].get('deepspeed')}", "",
          table, "", "![wall time per strategy](chart.png)", "", "## How the numbers are made", ""]
    md += [f"- {note}" for note in document["notes"]]
    md += ["", "## Commands", ""] + [f"- {row['strategy']}: `{row['command']}`" for row in rows]
    (folder / "results.md").write_text("\n".join(md) + "\n")
    write_chart(rows, folder / "chart.png")
    return rows


def library_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "accelerate", "peft", "deepspeed", "bitsandbytes", "datasets"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def parse_args(argv=None):
    summary, _, details = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--workload", choices=("tinyllama", "codellama34b"), default="tinyllama",
        help="reference workload to run (default: tinyllama); ignored with --smoke")
    add("--strategies", default=None,
        help=f"comma-separated, among {', '.join(STRATEGIES)} (default: the workload's reference set; "
             "smoke: ddp,zero2)")
    add("--layers", type=int, default=None,
        help="build the model with this many layers (default: all); results then also show a per-layer-scaled "
             "estimate for the full depth, labelled as such")
    add("--smoke", action="store_true",
        help="the same path on CPU with the bundled tiny model: 64 rows x 64 tokens, 2 processes, fp32")
    add("--output-dir", default=str(REPO / "results"),
        help="results root (default: results/); the run writes <output-dir>/<date>_<device>_torch<v>_transformers<v>/")
    add("--model-cache", default=None, help="where built models live (default: <output-dir>/models)")
    add("--gpus", type=int, default=None,
        help="GPUs to use (default: all visible; fewer: the first N of them, via CUDA_VISIBLE_DEVICES)")
    add("--batch-size", type=int, default=None, help="override the workload's micro-batch per process")
    add("--grad-accum", type=int, default=None, help="override the workload's gradient accumulation")
    add("--gradient-checkpointing", action="store_true",
        help="pass --gradient-checkpointing to the recipe; utilisation then counts the recompute (6N + 16 L h s)")
    add("--recipe-args", default="",
        help='more flags for every recipe launch, e.g. "--compile --packing" (scripts/speed_options.py measures them)')
    add("--peak-tflops", type=float, default=None,
        help="dense bf16 peak per GPU in TFLOP/s for MFU (default: the table by GPU name; smoke: "
             f"{CPU_NOMINAL_PEAK_TFLOPS} per CPU process, nominal)")
    add("--measure-peak", action="store_true",
        help="time a large bf16 matmul on the first GPU; used as the peak when the GPU is not in the table")
    add("--timeout", type=float, default=0, help="seconds after which a launch is stopped (default: none)")
    add("--dry-run", action="store_true", help="print the launch commands and exit (builds and runs nothing)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    workload = WORKLOADS["smoke" if args.smoke else args.workload]
    names = [s.strip() for s in (args.strategies or ",".join(workload.strategies)).split(",") if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or not names:
        sys.exit(f"error: unknown strategies {unknown or names}; choose among {', '.join(STRATEGIES)}")
    output_root = Path(args.output_dir).resolve()
    cache = Path(args.model_cache).resolve() if args.model_cache else output_root / "models"

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if args.smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a GPU box

    # Devices, peak.
    probe = ({"cuda": False, "count": 0} if args.dry_run and args.gpus else probe_devices(args.measure_peak, env))
    versions = library_versions()
    measured = probe.get("measured_tflops")
    if args.smoke:
        devices = 2
        device_label = "2 CPU processes"
        device_slug = "cpu-smoke"
        peak, peak_source = args.peak_tflops or CPU_NOMINAL_PEAK_TFLOPS, (
            "--peak-tflops" if args.peak_tflops else
            "nominal CPU figure per process (one core: 2 AVX2 FMA units x 8 fp32 lanes x 2 FLOP x ~3 GHz), "
            "not a measurement")
        sampler_ids = []
    else:
        visible = probe["count"]
        if visible == 0 and not args.dry_run:
            sys.exit("error: no GPU visible; use --smoke for the CPU path")
        devices = args.gpus or visible
        if devices == 0:
            sys.exit("error: no GPU visible; give --gpus N to print the commands of an N-GPU box")
        if visible and devices > visible:
            sys.exit(f"error: --gpus {devices} but only {visible} GPU(s) are visible")
        if visible and devices < visible:
            ids = nvml_indices(visible)[:devices]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
            os.environ["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
        name = (probe.get("names") or ["unknown GPU"])[0]
        device_label = f"{devices}x {name}"
        device_slug = f"{devices}x-{slug(name.replace('NVIDIA ', ''))}"
        found = table_peak(name)
        if args.peak_tflops:
            peak, peak_source = args.peak_tflops, "--peak-tflops"
        elif found:
            peak, peak_source = found[0], f"table: {found[1]} dense bf16"
        elif measured:
            peak, peak_source = measured, f"measured ({probe.get('measured_with')}): {name} is not in the table"
        elif args.dry_run:
            peak, peak_source = 1.0, "dry run"
        else:
            sys.exit(f"error: {name!r} is not in the peak table; give --peak-tflops (dense bf16 TFLOP/s per GPU) "
                     "or --measure-peak")
        sampler_ids = nvml_indices(devices)

    full_layers = shape_of(workload.config or TINY_CONFIG).layers
    layers = args.layers or full_layers
    if args.smoke and args.layers:
        sys.exit("error: --layers applies to the GPU workloads, not to --smoke")
    if not 1 <= layers <= full_layers:
        sys.exit(f"error: --layers must be between 1 and {full_layers}")
    batch_size = args.batch_size or workload.batch_size
    grad_accum = args.grad_accum or workload.grad_accum
    date = datetime.date.today().isoformat()
    folder = output_root / (f"{date}_{device_slug}_torch{slug(versions.get('torch', '?'))}"
                            f"_transformers{slug(versions.get('transformers', '?'))}")
    model = ensure_model(workload, layers, cache, dry_run=args.dry_run)
    data = output_root / "data" / f"text-{workload.rows}x{workload.max_length}"
    shape = shape_of(model / "config.json") if (model / "config.json").exists() else shape_of(
        workload.config or TINY_CONFIG, layers)
    settings = {"workload": workload, "model": model, "data": data, "runs": folder / "runs", "devices": devices,
                "device_label": device_label, "smoke": args.smoke, "batch_size": batch_size, "grad_accum": grad_accum,
                "gradient_checkpointing": args.gradient_checkpointing, "timeout": args.timeout, "shape": shape,
                "layers": layers, "full_layers": full_layers, "peak_tflops": peak,
                "recipe_args": tuple(shlex.split(args.recipe_args))}

    if args.dry_run:
        for name in names:
            strategy = STRATEGIES[name]
            processes = 1 if name == "model_parallel" else devices
            output = folder / "runs" / workload.name / name
            print(shell_line(launch_command(strategy, processes, model, data, output, workload, batch_size,
                                            grad_accum, args.smoke, args.gradient_checkpointing,
                                            recipe_args=settings["recipe_args"])))
        return 0

    ensure_data(data, workload.rows, workload.max_length)
    environment = {"date": date, "device_label": device_label, "devices": devices, "probe": probe,
                   "peak_tflops": peak, "peak_source": peak_source, "measured_tflops": measured,
                   "measured_with": probe.get("measured_with"), "versions": versions, "smoke": args.smoke,
                   "python": sys.version.split()[0]}
    print(f"benchmark: {workload.label}; {device_label}; model {model} ({layers} layers); data {data}; "
          f"peak {peak:g} TFLOP/s per device ({peak_source}); results in {folder}", flush=True)

    def log(message: str) -> None:
        print(message, flush=True)

    rows = [run_strategy(STRATEGIES[name], settings, env, sampler_ids, log) for name in names]
    all_rows = write_results(folder, environment, rows)
    print()
    print(markdown_table(all_rows))
    print(f"\nwritten: {folder / 'results.md'}, {folder / 'results.json'}, {folder / 'chart.png'}")
    return 1 if any(row.get("status") != "ok" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
