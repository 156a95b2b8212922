"""Weights, gradients and optimizer state on the busiest GPU: what the rank keeps at rest
(`resident_bytes`) plus what is only transient: gathered layers in flight, DDP's bucket copy,
DeepSpeed's reduce bucket, ZeRO-1's unpartitioned gradients of the backward, and the NF4
constants (which are not parameters)."""

from __future__ import annotations

from .dtypes import quantized_bytes_per_weight, state_bytes_per_parameter
from .resident import Stage, _stage_parameters, resident_bytes
from .shapes import ModelShape
from .strategies import DEEPSPEED, FSDP, ZERO3, _check, tensor_parallel_size

# DeepSpeed's gradient reduce bucket: accelerate's generated DeepSpeed config leaves
# `reduce_bucket_size` unset, so DeepSpeed's default of 5e8 elements applies.
DEEPSPEED_REDUCE_BUCKET = 500_000_000
# Transformer layers whose unsharded weights are alive at once under FSDP / ZeRO-3: the one
# computing and the one being prefetched.
LAYERS_IN_FLIGHT = 2


def _unsharded_bytes(shape: ModelShape, method: str, precision: str, layers: int, embedding: bool, head: bool,
                     lora_rank: int, lora_targets) -> float:
    """Bytes of parameters gathered for compute: floats in the compute dtype (FSDP2's param_dtype,
    DeepSpeed's bf16), 4-bit weights as their packed n/2 bytes."""
    params = _stage_parameters(shape, method, Stage(layers, embedding, head), lora_rank, lora_targets)
    c = 4 if precision == "fp32" else 2
    return (params["trained"] + params["frozen"]) * c + params["quantized"] * 0.5


def fsdp_units(shape: ModelShape) -> list[dict]:
    """The kinds of part accelerate's FSDP2 preparation shards as a unit of its own, as `Stage`
    arguments: a decoder block (`shape.layers` of them, all alike), the embedding, and the final norm
    with the lm_head."""
    return [{"layers": 1, "embedding": False, "head": False}, {"layers": 0, "embedding": True, "head": False},
            {"layers": 0, "embedding": False, "head": True}]


def in_flight_weight_bytes(shape: ModelShape, method: str, strategy: str, precision: str = "bf16",
                           lora_rank: int = 16, lora_targets="all-linear", gpus: int = 1) -> int:
    """Unsharded parameters alive on a GPU on top of its shard.

    - fsdp_full_shard / fsdp_hybrid / fsdp_offload: two units at once, the one computing and the
      one prefetched. accelerate shards every decoder layer, the embedding, and the final norm with
      the lm_head as units of their own (`fsdp_units`), so the planner counts the two largest of them:
      two blocks for CodeLlama-34B, the embedding and the head for TinyLlama-1.1B, whose vocabulary
      matrices outweigh a block (both as measured on FSDP2 ranks: results/2026-11-24_cpu_fake-process-group-plan/).
    - zero3 / zero3_offload: DeepSpeed gathers module by module: 2 blocks + the larger of the
      embedding and lm_head (gathered while the logits are computed).
    - fsdp_grad_op: reshard-after-forward off: every unit stays gathered from its forward to its
      backward, so at the start of the backward the whole model is unsharded, and one unit more (the
      largest; measured so at both sizes).
    - fsdp_tp: full shard's units, each gathered across the groups only: its tensor parallel part
      (1/T of the unit, T = `tensor_parallel_size(strategy, gpus)`).
    - ddp / zero1 / zero2 / tp / model_parallel: nothing (each rank's weights are already whole,
      or its tensor parallel part).
    QLoRA adds one dequantised linear (the largest, in the compute dtype) on every strategy:
    bitsandbytes dequantises the weight of the linear it runs.
    """
    _check(method, strategy, precision)

    def largest_units() -> list[float]:  # the units' bytes, ascending; a block twice: two can be in flight at once
        block, embedding, head = (_unsharded_bytes(shape, method, precision, **unit, lora_rank=lora_rank,
                                                   lora_targets=lora_targets) for unit in fsdp_units(shape))
        return sorted([block] * min(2, shape.layers) + [embedding, head])

    if strategy in ("fsdp_full_shard", "fsdp_hybrid", "fsdp_offload"):
        flight = sum(largest_units()[-2:])
    elif strategy == "fsdp_tp":
        flight = sum(largest_units()[-2:]) / tensor_parallel_size(strategy, gpus)
    elif strategy in ZERO3:
        layers = min(LAYERS_IN_FLIGHT, shape.layers)
        blocks = _unsharded_bytes(shape, method, precision, layers, False, False, lora_rank, lora_targets)
        edges = max(_unsharded_bytes(shape, method, precision, 0, True, False, lora_rank, lora_targets),
                    _unsharded_bytes(shape, method, precision, 0, False, True, lora_rank, lora_targets))
        flight = blocks + edges
    elif strategy == "fsdp_grad_op":
        flight = _unsharded_bytes(shape, method, precision, shape.layers, True, True, lora_rank, lora_targets)
        flight += largest_units()[-1]
    else:
        flight = 0
    if method == "qlora":
        flight += max(i * o for i, o in shape.linear_shapes().values()) * (4 if precision == "fp32" else 2)
    return int(flight)


def quantization_constant_bytes(shape: ModelShape, method: str, stage: Stage | None = None) -> int:
    """The NF4 constants of QLoRA's 4-bit linears: quantized * (0.5159 - 0.5) bytes, replicated on
    every GPU that computes: they are attributes of the 4-bit weights, not parameters, so FSDP /
    ZeRO-3 do not shard them (with offload they stay on the GPU too). 0 for full and LoRA."""
    if method != "qlora":
        return 0
    stage = stage or Stage(shape.layers)
    quantized = (sum(shape.linear_parameters_per_layer().values()) - shape.fused_expert_parameters_per_layer()) * stage.layers
    return int(quantized * (quantized_bytes_per_weight() - 0.5))


def in_flight_gradient_bytes(shape: ModelShape, method: str, strategy: str, precision: str = "bf16",
                             lora_rank: int = 16, lora_targets="all-linear") -> int:
    """FSDP's unsharded gradients on a GPU on top of its sharded ones: the largest unit's (`fsdp_units`)
    trained parameters in the compute dtype, twice: as the backward wrote them and copied into the
    reduce-scatter's input (accelerate reduces in the compute dtype); with offload too (reduced on the
    GPU). An upper bound: on fake FSDP2 ranks of TinyLlama-1.1B and CodeLlama-34B the step's gradient
    peak was 0 to 8% below the plan with it, 5 to 32% above it without
    (results/2026-11-24_cpu_fake-process-group-plan/). 0 for every other strategy."""
    if strategy not in FSDP:
        return 0
    largest = max(_stage_parameters(shape, method, Stage(**unit), lora_rank, lora_targets)["trained"]
                  for unit in fsdp_units(shape))
    return int(2 * largest * (4 if precision == "fp32" else 2))


def weight_bytes(shape: ModelShape, method: str, strategy: str, gpus: int, lora_rank: int = 16,
                 lora_targets="all-linear", precision: str = "bf16", stage: Stage | None = None) -> int:
    """Weights on the busiest GPU = resident (`resident_bytes`: the stored parameters / the weight
    divisor) + the NF4 constants (`quantization_constant_bytes`) + the unsharded copies in flight
    (`in_flight_weight_bytes`)."""
    stage = stage or Stage(shape.layers)
    resident = resident_bytes(shape, method, strategy, gpus, lora_rank, lora_targets, precision, stage)["weights"]
    flight = in_flight_weight_bytes(shape, method, strategy, precision, lora_rank, lora_targets, gpus)
    return int(resident + quantization_constant_bytes(shape, method, stage) + flight)


def gradient_bytes(shape: ModelShape, method: str, strategy: str, gpus: int, lora_rank: int = 16,
                   lora_targets="all-linear", precision: str = "bf16", stage: Stage | None = None) -> int:
    """Gradients of the trained parameters on the busiest GPU = resident (`resident_bytes`:
    trained * grad bytes / the gradient divisor) + what only lives within a step:

    - DDP (gpus > 1): its reducer keeps the gradients in flat buckets *besides* `param.grad`
      (accelerate's default `gradient_as_bucket_view=False`): one more copy, + trained * grad bytes.
    - ZeRO-1: the backward accumulates whole gradients in `param.grad`; only the step reduces
      them to this rank's partition and frees the rest: the peak is the whole gradient,
      + trained * grad bytes * (1 - 1/N) on top of the partition.
    - DeepSpeed: the reduce bucket, min(trained, 5e8) elements * grad bytes (its default
      `reduce_bucket_size`), also with offload (the gradients are reduced on the GPU).
    - FSDP: the unsharded gradient of the unit being reduced (`in_flight_gradient_bytes`).
    """
    stage = stage or Stage(shape.layers)
    per = state_bytes_per_parameter(method, strategy, precision)
    trained = _stage_parameters(shape, method, stage, lora_rank, lora_targets)["trained"]
    whole = trained * per["trained_grad"]
    grads = resident_bytes(shape, method, strategy, gpus, lora_rank, lora_targets, precision, stage)["gradients"]
    if strategy == "ddp" and gpus > 1:
        grads += whole
    if strategy == "zero1":  # the whole gradient of the backward, which the partition is cut from
        grads = whole
    if strategy in DEEPSPEED:
        grads += min(trained, DEEPSPEED_REDUCE_BUCKET) * per["trained_grad"]
    return int(grads + in_flight_gradient_bytes(shape, method, strategy, precision, lora_rank, lora_targets))


def optimizer_bytes(shape: ModelShape, method: str, strategy: str, gpus: int, lora_rank: int = 16,
                    lora_targets="all-linear", precision: str = "bf16", stage: Stage | None = None) -> int:
    """AdamW state on the busiest GPU, all of it resident (`resident_bytes`): trained * (8, or 12
    with DeepSpeed's fp32 master partitions) / divisor (N for ZeRO-1/2/3 and FSDP, the shard group
    for hybrid, 0 with offload)."""
    return resident_bytes(shape, method, strategy, gpus, lora_rank, lora_targets, precision, stage)["optimizer"]
