"""Per GPU, and the plan: the busiest GPU's total (`per_gpu_bytes`), what a GPU may hold (`usable_bytes`,
`fits`), the largest micro-batch that fits (`max_micro_batch`), and `plan()`, which evaluates every
strategy and recommends two of them.

Sizes are bytes; the tables print GiB (2**30), and `gpu_memory_gb` is the size a GPU is sold
as ("a 48 GB L40S", "an 80 GB H100"), which is GiB in practice.
"""

from __future__ import annotations

from .activations import activation_bytes
from .peak import gradient_bytes, optimizer_bytes, weight_bytes
from .resident import Stage, model_parallel_stages
from .shapes import ModelShape
from .strategies import STRATEGIES, _check, impossible, possible_strategies

# Keep 10% of every GPU free: the CUDA context (~0.5-1 GiB), NCCL buffers, the caching
# allocator's fragmentation and the short-lived temporaries this model does not itemise.
HEADROOM = 0.9
GiB = 2**30
MAX_MICRO_BATCH = 256


def per_gpu_bytes(shape: ModelShape, method: str, strategy: str, gpus: int, batch_size: int = 8,
                  seq_len: int = 512, gradient_checkpointing: int = 0, lora_rank: int = 16,
                  lora_targets="all-linear", precision: str = "bf16", attention: str = "sdpa",
                  lora_dropout: float = 0.05) -> dict:
    """Memory of the busiest GPU: {"weights", "gradients", "optimizer", "activations", "total"} in
    bytes. `batch_size` is the micro-batch per GPU (the recipes' --batch-size), `seq_len` the
    padded length (--max-length is the worst case). Model parallel: the heavier of the GPUs."""
    _check(method, strategy, precision, attention)
    if gpus < 1 or batch_size < 1 or seq_len < 1:
        raise ValueError("gpus, batch_size and seq_len must be >= 1")
    why_not = impossible(method, strategy, gpus, shape, lora_targets)
    if why_not:
        raise ValueError(f"{method} with {strategy} on {gpus} GPU(s) does not run: {why_not}")
    stages = model_parallel_stages(shape, gpus) if strategy == "model_parallel" else [Stage(shape.layers)]
    best = None
    for stage in stages:
        common = dict(lora_rank=lora_rank, lora_targets=lora_targets, precision=precision, stage=stage)
        result = {
            "weights": weight_bytes(shape, method, strategy, gpus, **common),
            "gradients": gradient_bytes(shape, method, strategy, gpus, **common),
            "optimizer": optimizer_bytes(shape, method, strategy, gpus, **common),
            "activations": activation_bytes(shape, method, strategy, batch_size, seq_len, gradient_checkpointing,
                                            attention=attention, lora_dropout=lora_dropout, gpus=gpus, **common),
        }
        result["total"] = sum(result.values())
        if best is None or result["total"] > best["total"]:
            best = result
    return best


def usable_bytes(gpu_memory_gb: float) -> float:
    """What a plan may use of a GPU: `HEADROOM` (90%) of its memory, GiB-sized."""
    return gpu_memory_gb * GiB * HEADROOM


def fits(total_bytes: int, gpu_memory_gb: float) -> bool:
    """total <= 0.9 * GPU memory: 10% stays free for the CUDA context, NCCL and fragmentation."""
    return total_bytes <= usable_bytes(gpu_memory_gb)


def max_micro_batch(shape: ModelShape, method: str, strategy: str, gpus: int, gpu_memory_gb: float,
                    seq_len: int = 512, gradient_checkpointing: int = 0, lora_rank: int = 16,
                    lora_targets="all-linear", precision: str = "bf16", attention: str = "sdpa",
                    lora_dropout: float = 0.05) -> int:
    """The largest micro-batch (1..256) that fits, by bisection (memory grows with the batch);
    0 when not even one sequence fits."""
    def ok(batch: int) -> bool:
        total = per_gpu_bytes(shape, method, strategy, gpus, batch, seq_len, gradient_checkpointing, lora_rank,
                              lora_targets, precision, attention, lora_dropout)["total"]
        return fits(total, gpu_memory_gb)

    if not ok(1):
        return 0
    low, high = 1, MAX_MICRO_BATCH
    if ok(high):
        return high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if ok(middle) else (low, middle)
    return low


def plan(shape: ModelShape, method: str, gpus: int, gpu_memory_gb: float, batch_size: int = 8,
         seq_len: int = 512, gradient_checkpointing: int = 0, lora_rank: int = 16,
         lora_targets="all-linear", precision: str = "bf16", attention: str = "sdpa",
         lora_dropout: float = 0.05) -> dict:
    """Every strategy on `gpus` GPUs of `gpu_memory_gb`, and the two recommendations.

    - fewest_gpus: the smallest n in 1..gpus on which some strategy fits at this micro-batch;
      among those that fit on n, the fastest (`SPEED_ORDER`: DDP first, then sharding); only the
      strategies the recipes run for this method (`possible_strategies`: no QLoRA under tensor parallel).
    - fastest: the first strategy in `SPEED_ORDER` that fits on all `gpus` GPUs.
    Each names its config file and the largest micro-batch that fits. When nothing fits, both are
    None and `recommendation["reason"]` says what came closest and what to change.
    """
    settings = dict(batch_size=batch_size, seq_len=seq_len, gradient_checkpointing=gradient_checkpointing,
                    lora_rank=lora_rank, lora_targets=lora_targets, precision=precision, attention=attention,
                    lora_dropout=lora_dropout)
    batch_free = {k: v for k, v in settings.items() if k != "batch_size"}

    def evaluate(strategy: str, n: int) -> dict:
        return per_gpu_bytes(shape, method, strategy, n, **settings)

    strategies = []
    for strategy in possible_strategies(method, gpus, shape, lora_targets):
        usage = evaluate(strategy, gpus)
        strategies.append({"strategy": strategy, "config": STRATEGIES[strategy], "per_gpu_bytes": usage,
                           "fits": fits(usage["total"], gpu_memory_gb)})

    fastest = None
    for entry in strategies:
        if entry["fits"]:
            batch = max_micro_batch(shape, method, entry["strategy"], gpus, gpu_memory_gb, **batch_free)
            fastest = {"strategy": entry["strategy"], "config": entry["config"], "max_micro_batch": batch}
            break

    fewest = None
    for n in range(1, gpus + 1):
        for strategy in possible_strategies(method, n, shape, lora_targets):
            if fits(evaluate(strategy, n)["total"], gpu_memory_gb):
                batch = max_micro_batch(shape, method, strategy, n, gpu_memory_gb, **batch_free)
                fewest = {"strategy": strategy, "config": STRATEGIES[strategy], "gpus": n, "max_micro_batch": batch}
                break
        if fewest:
            break

    recommendation = {"fewest_gpus": fewest, "fastest": fastest}
    if fewest is None or fastest is None:
        smallest = min(strategies, key=lambda entry: entry["per_gpu_bytes"]["total"])
        recommendation["reason"] = (
            f"nothing fits {gpus} x {gpu_memory_gb:g} GiB at micro-batch {batch_size} x {seq_len} tokens: the "
            f"smallest need is {smallest['per_gpu_bytes']['total'] / GiB:.1f} GiB per GPU ({smallest['strategy']}) "
            f"for {usable_bytes(gpu_memory_gb) / GiB:.1f} GiB usable; try "
            + ("" if gradient_checkpointing else "--gradient-checkpointing, ")
            + "a smaller micro-batch or sequence length, "
            + ("qlora, " if method != "qlora" else "")
            + "or more GPUs"
        )
    return {"model": shape.name, "method": method, "gpus": gpus, "gpu_memory_gb": gpu_memory_gb,
            "strategies": strategies, "recommendation": recommendation}
