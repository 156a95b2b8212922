"""What each rank keeps at rest (`resident_bytes`): the local part of every parameter, its gradient
and its optimizer state as they stand when the optimizer steps, i.e. the parameters of the part of
the model a GPU runs (`Stage`) at their bytes per parameter, split as each strategy shards them
(the divisors); and the CPU RAM the offload configs keep it in (`cpu_offload_bytes`).

That is what every launch measures into run.json's `memory_by_rank` (`runlog.held_bytes`), and
tests/test_plan_vs_ranks.py checks the two against each other on every strategy. What is only
transient is added per GPU in `peak.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .dtypes import state_bytes_per_parameter
from .shapes import ModelShape, lora_parameters, lora_parameters_per_layer, lora_target_names
from .strategies import TENSOR_PARALLEL, _check, tensor_parallel_size


@dataclass
class Stage:
    """The part of the model one GPU runs: `layers` blocks, and whether it holds the embedding
    (first GPU) and the final norm + lm_head (last GPU). Every strategy but model parallel runs
    the whole model on every GPU."""

    layers: int
    embedding: bool = True
    head: bool = True


def model_parallel_stages(shape: ModelShape, gpus: int) -> list[Stage]:
    """`device_map="auto"` balances the blocks over the GPUs: the first `layers % gpus` GPUs get
    ceil(layers / gpus) blocks, the others floor; the embedding sits on the first GPU, the final
    norm and lm_head on the last (so the busiest GPU is one of those two)."""
    base, extra = divmod(shape.layers, gpus)
    return [Stage(base + (1 if k < extra else 0), embedding=k == 0, head=k == gpus - 1) for k in range(gpus)]


def hybrid_shard_size(gpus: int) -> int:
    """FSDP hybrid shard group size: the largest divisor of N that is <= sqrt(N) (2 on 4 GPUs, the
    2 x 2 mesh of fsdp_hybrid.yaml; 2 on 8; 4 on 16; 1 on 1 or 2 GPUs, i.e. replication only).

    Hybrid sharding pays off when the shard group sits on fast links (one machine) and only the
    replicas talk over the slow ones; on a single machine there is no such boundary, so the
    planner takes the balanced mesh the shipped config uses. Set `dp_shard_size` in the config
    to your GPUs per machine on a cluster, and divide by that instead.
    """
    return max(d for d in range(1, int(math.isqrt(gpus)) + 1) if gpus % d == 0)


def _counts(shape: ModelShape, method: str, lora_rank: int, lora_targets) -> dict:
    """Parameter counts per group: one block's linears / norms / adapters, and the model's edges."""
    counts = shape.parameter_counts()
    lora_layer = lora_parameters_per_layer(shape, lora_rank, lora_targets) if method != "full" else 0
    lora_head = lora_parameters(shape, lora_rank, lora_targets) - lora_layer * shape.layers if method != "full" else 0
    return {
        "layer_linear": sum(counts["linear_per_layer"].values()),
        "layer_fused_experts": shape.fused_expert_parameters_per_layer(),  # part of layer_linear
        "layer_norm": 2 * shape.hidden + shape.hidden * shape.experts,  # + a mixture of experts' router
        "layer_lora": lora_layer,
        "embedding": counts["embedding"],
        "head": counts["lm_head"] + shape.hidden,  # lm_head + final norm
        "head_lora": lora_head,
    }


def _stage_parameters(shape: ModelShape, method: str, stage: Stage, lora_rank: int, lora_targets) -> dict:
    """Parameters of a stage in three groups: `trained`, `frozen` (stored as floats) and `quantized`."""
    n = _counts(shape, method, lora_rank, lora_targets)
    linear = n["layer_linear"] * stage.layers
    floats = (n["layer_norm"] * stage.layers + (n["embedding"] if stage.embedding else 0)
              + (n["head"] if stage.head else 0))
    lora = n["layer_lora"] * stage.layers + (n["head_lora"] if stage.head else 0)
    if method == "full":
        return {"trained": linear + floats, "frozen": 0, "quantized": 0}
    if method == "lora":
        return {"trained": lora, "frozen": linear + floats, "quantized": 0}
    experts = n["layer_fused_experts"] * stage.layers  # bitsandbytes leaves them in the float dtype
    return {"trained": lora, "frozen": floats + experts, "quantized": linear - experts}


WHERE = ("gpu", "anywhere")
# The offload configs and the config that holds the same shards when nothing is offloaded.
OFFLOADED = {"fsdp_offload": "fsdp_full_shard", "zero3_offload": "zero3"}


def _divisors(strategy: str, gpus: int, where: str = "gpu") -> tuple[int, int, int]:
    """How many ways (weights, gradients, optimizer) are split at rest; 0 = none of it is there.

    ddp: 1, 1, 1 (all replicated); zero1 and zero2: 1, N, N (ZeRO-1 too holds only its gradient
    partition once the step has reduced the gradients; its unpartitioned gradients of the backward
    are transient, see `gradient_bytes`); zero3 / fsdp_full_shard / fsdp_grad_op: N, N, N (grad-op's
    weights are sharded at rest, its gathered copy is in flight); fsdp_hybrid: G, G, G with
    G = `hybrid_shard_size(N)`; model_parallel and pipeline: a stage holds everything of its own layers.
    Offload (fsdp_offload, zero3_offload): where="gpu": 0, 0, 0 (in CPU RAM); where="anywhere":
    N, N, N, the shards of their twins fsdp_full_shard / zero3, held in the rank's CPU RAM.
    """
    if where not in WHERE:
        raise ValueError(f"where must be one of {WHERE}, not {where!r}")
    if strategy in OFFLOADED:
        return (0, 0, 0) if where == "gpu" else _divisors(OFFLOADED[strategy], gpus)
    if strategy in ("ddp", "model_parallel", "pipeline"):
        return 1, 1, 1
    if strategy in ("zero1", "zero2"):
        return 1, gpus, gpus
    if strategy == "fsdp_hybrid":
        g = hybrid_shard_size(gpus)
        return g, g, g
    return gpus, gpus, gpus


def _share(value: float, divisor: int) -> float:
    return 0 if divisor == 0 else value / divisor


def _unsharded_state_bytes(shape: ModelShape, method: str, strategy: str, stage: Stage, lora_rank: int,
                           lora_targets, precision: str) -> dict:
    """{"weights", "gradients", "optimizer"} of a stage before any sharding (all ranks' shares together).

    weights = trained * trained_weight + frozen * frozen bytes + quantized * 0.5 (the packed NF4
    weights: n/2 bytes in any storage dtype); gradients = trained * trained_grad; optimizer =
    trained * trained_optimizer (`state_bytes_per_parameter`).
    """
    per = state_bytes_per_parameter(method, strategy, precision)
    params = _stage_parameters(shape, method, stage, lora_rank, lora_targets)
    return {
        "weights": params["trained"] * per["trained_weight"] + params["frozen"] * per["frozen"]
        + params["quantized"] * 0.5,
        "gradients": params["trained"] * per["trained_grad"],
        "optimizer": params["trained"] * per["trained_optimizer"],
    }


def resident_bytes(shape: ModelShape, method: str, strategy: str, gpus: int, lora_rank: int = 16,
                   lora_targets="all-linear", precision: str = "bf16", stage: Stage | None = None,
                   where: str = "gpu") -> dict:
    """What one rank keeps at rest: {"weights", "gradients", "optimizer"} in bytes, as they stand
    when its optimizer steps (the moment run.json's `memory_by_rank` is measured).

    - weights: this rank's part of every model parameter (its ZeRO-3 partition, its FSDP shard or
      the whole tensor): trained * trained_weight + frozen * frozen bytes + quantized * 0.5, / the
      weight divisor. The NF4 constants are not parameters and not in it (`weight_bytes` adds them).
    - gradients: trained * trained_grad / the gradient divisor: DDP's and FSDP's `param.grad` (the
      FSDP shard), DeepSpeed's gradient of its fp32 partition (ZeRO-1 and ZeRO-2: by the step the
      other ranks' parts are freed).
    - optimizer: trained * trained_optimizer / the optimizer divisor: AdamW's m and v, plus
      DeepSpeed's flat fp32 master partitions.

    `where="gpu"` (what the per-GPU plan adds up): the offload configs keep none of it on the GPU.
    `where="anywhere"`: in any memory of the rank (GPU or its CPU RAM): the offload configs hold
    the shards their twins (fsdp_full_shard, zero3) hold on the GPU, in CPU RAM; this is what a
    CPU run measures, where everything is in RAM.

    Not in it, because it comes and goes within a step (`weight_bytes` and `gradient_bytes` add it):
    unsharded layers in flight, DDP's bucket copy, DeepSpeed's reduce bucket, ZeRO-1's
    unpartitioned gradients of the backward; nor the activations.

    The shares are exact fractions, total / divisor, as the ranks hold them when every split
    divides. Where a size does not, the ranks' shares differ by a few elements per parameter (FSDP2
    chunks every parameter's dim 0, so a rank holds up to one row more or less of it; ZeRO-3 pads
    each parameter's partition, ZeRO-1/2 their flat group, to a multiple of the ranks), which the
    planner leaves out.
    """
    _check(method, strategy, precision)
    stage = stage or Stage(shape.layers)
    if strategy in TENSOR_PARALLEL:
        return _tensor_parallel_resident(shape, method, strategy, gpus, lora_rank, lora_targets, precision)
    state = _unsharded_state_bytes(shape, method, strategy, stage, lora_rank, lora_targets, precision)
    divisors = _divisors(strategy, gpus, where)
    return {kind: int(_share(state[kind], divisor)) for kind, divisor in zip(state, divisors)}


def _tensor_parallel_resident(shape: ModelShape, method: str, strategy: str, gpus: int, lora_rank: int,
                              lora_targets, precision: str) -> dict:
    """tp / fsdp_tp at rest, as transformers splits a Llama-style model: every block linear, the
    embedding and lm_head are split T ways (T = `tensor_parallel_size`); the norms are whole on every
    rank of a group. fsdp_tp then shards all of it over the F = N / T groups. LoRA (tp only, on the
    column-split linears): B (out x R) is split with its linear, A (R x in) is whole.

    One exception, measured (transformers 5.23): under tp the embedding's gradient is whole on every
    rank (its split style hands back a replicated gradient); FSDP's reduce-scatter shards it in fsdp_tp."""
    tp = tensor_parallel_size(strategy, gpus)
    groups = gpus // tp
    per = state_bytes_per_parameter(method, strategy, precision)
    counts = shape.parameter_counts()
    split = counts["linear"] + counts["embedding"] + counts["lm_head"]
    whole = counts["norms"]
    if method == "full":
        trained_split, trained_whole, frozen_split, frozen_whole = split, whole, 0, 0
    else:
        adapted = [(i, o) for name, (i, o) in shape.linear_shapes().items() if name in lora_target_names(lora_targets)]
        trained_split = lora_rank * sum(o for _, o in adapted) * shape.layers
        trained_whole = lora_rank * sum(i for i, _ in adapted) * shape.layers
        frozen_split, frozen_whole = split, whole

    def held(split_count, whole_count, bytes_per):
        return (split_count / (tp * groups) + whole_count / groups) * bytes_per

    whole_embedding_grad = counts["embedding"] * (1 - 1 / tp) if method == "full" and groups == 1 else 0
    return {
        "weights": int(held(trained_split, trained_whole, per["trained_weight"])
                       + held(frozen_split, frozen_whole, per["frozen"])),
        "gradients": int(held(trained_split, trained_whole, per["trained_grad"])
                         + whole_embedding_grad * per["trained_grad"]),
        "optimizer": int(held(trained_split, trained_whole, per["trained_optimizer"])),
    }


def cpu_offload_bytes(shape: ModelShape, method: str, strategy: str, gpus: int, lora_rank: int = 16,
                      lora_targets="all-linear", precision: str = "bf16") -> int:
    """CPU RAM the offload variants need for the training state, all processes of a machine
    together: what `resident_bytes` holds anywhere but not on the GPU, i.e. the stored weights, the
    gradients and the optimizer state, unsharded (0 for the strategies that keep everything on the
    GPUs)."""
    if strategy not in OFFLOADED:
        return 0
    state = _unsharded_state_bytes(shape, method, strategy, Stage(shape.layers), lora_rank, lora_targets, precision)
    return int(sum(state.values()))
