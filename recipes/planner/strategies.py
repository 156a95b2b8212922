"""What the planner plans for: the strategies (each with its config file, in the order of expected
speed), the methods and the attention implementations, and the check of a request against them."""

from __future__ import annotations

# Strategy -> its config file, in the order of expected speed (fastest first); see `SPEED_ORDER`.
STRATEGIES = {
    "ddp": "accelerate_configs/ddp.yaml",
    "zero1": "accelerate_configs/zero1.yaml",
    "zero2": "accelerate_configs/zero2.yaml",
    "fsdp_grad_op": "accelerate_configs/fsdp_grad_op.yaml",
    "fsdp_hybrid": "accelerate_configs/fsdp_hybrid.yaml",
    "fsdp_full_shard": "accelerate_configs/fsdp.yaml",
    "zero3": "accelerate_configs/zero3.yaml",
    "fsdp_offload": "accelerate_configs/fsdp_offload.yaml",
    "zero3_offload": "accelerate_configs/zero3_offload.yaml",
    "model_parallel": "accelerate_configs/model_parallel.yaml",
}

# Expected speed, fastest first. Traffic per optimizer step and GPU, P = bytes of the parameters
# (frozen ones included where they are sharded) and G = bytes of the trained gradients:
# - ddp: one all-reduce of G (~2G), overlapped with the backward; nothing else.
# - zero1: reduce-scatter G + all-gather of the updated weights: also ~2G, plus bookkeeping.
# - zero2: the same, the gradients reduce-scattered bucket by bucket during the backward.
# - fsdp_grad_op: all-gather P once (forward) + reduce-scatter G; the weights stay gathered
#   until the backward, so it skips full shard's second all-gather.
# - fsdp_hybrid: full-shard traffic inside a shard group only, plus a gradient all-reduce across
#   the groups: cheaper than full shard (most on the fast links).
# - fsdp_full_shard ~ zero3: all-gather P in the forward, again in the backward, reduce-scatter
#   G: ~2P + G, every layer waiting on its all-gather. For LoRA, P is the whole frozen base
#   while G is only the adapters: sharding costs far more than it does for full fine-tuning.
# - fsdp_offload ~ zero3_offload: the same plus every parameter and gradient over PCIe and the
#   optimizer step on the CPU: several times slower.
# - model_parallel: little traffic, but the layers run one GPU after the other, so only ~1/N of
#   the GPUs compute at any time.
SPEED_ORDER = tuple(STRATEGIES)
DEEPSPEED = ("zero1", "zero2", "zero3", "zero3_offload")
FSDP = ("fsdp_full_shard", "fsdp_grad_op", "fsdp_hybrid", "fsdp_offload")
METHODS = ("full", "lora", "qlora")
ATTENTIONS = ("sdpa", "flash", "eager")


def _check(method: str, strategy: str, precision: str, attention: str = "sdpa") -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, not {method!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {tuple(STRATEGIES)}, not {strategy!r}")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be bf16 or fp32, not {precision!r}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, not {attention!r}")
