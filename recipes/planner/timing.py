"""How long a step takes: an estimate per strategy from the step's FLOPs and the bytes each strategy
moves (`step_time`), for a `Machine` (the GPU, its link and the two assumptions: the share of the
peak the matmuls sustain and the collectives' bandwidth).

The model, per micro-batch on each GPU:

- compute = FLOPs / (peak x mfu). FLOPs per token (`flops_per_token`): forward 2 per active matmul
  weight (the block linears a token passes through, the lm_head) + attention 4 x layers x seq x heads
  x head_dim; backward twice the forward for full fine-tuning, once the matmuls (input gradients
  only: a frozen weight gets none) and twice the attention for LoRA / QLoRA, + 6 per adapter
  parameter; gradient checkpointing adds the forward of the recomputed blocks (in full fine-tuning
  without their last linear, which torch's checkpoint need not redo). Tensor parallel divides it by
  its size T, sequence parallel by its group (each GPU a slice of every sequence, the attention over
  the whole sequence for its share of the heads).
- communication: the bytes a ring collective moves per GPU (all-reduce 2(n-1)/n x size, all-gather
  and reduce-scatter (n-1)/n) over the link's bus bandwidth. Where the strategy overlaps it with
  compute (FSDP's and ZeRO-3's prefetched gathers, DDP's and ZeRO's gradient reduction during the
  backward) only what exceeds the compute it hides behind counts; tensor parallel's activation
  all-reduces, model parallel's copies between GPUs, ZeRO's gather of the updated weights and the
  offload copies are on the critical path.
- other: the optimizer step (bound by memory bandwidth; on the CPU for offload) and QLoRA's
  dequantisation of each 4-bit weight per forward, backward and recomputation.
- idle: model parallel runs the whole micro-batch through one GPU after the other, so its step is
  the whole model's compute on one GPU while the other n-1 wait. A pipeline of n stages runs the m
  micro-batches at once, each stage its 1/n of every one, in m + n - 1 time slots: idle
  (n - 1) / (m + n - 1) of the step (the bubble of 1F1B and GPipe). Interleaved over v parts per
  stage: v m + n - 1 slots of 1/(n v) each, every slot sending a hidden state. Pipelines replicated
  over the other GPUs sum each stage's gradients across the replicas after the step.

Per step: grad_accum micro-batches + the per-step collectives + the optimizer step; per epoch:
ceil(rows / global batch) steps.

Preference pairs (`pairs`: recipes/dpo.py, dpo_full.py): a micro-batch of B pairs is one forward and
backward of 2B rows (chosen and rejected); under LoRA / QLoRA each micro-batch also runs the reference's
forward (the base, adapters off, no gradient: its FLOPs, its gathers under full sharding, its all-reduces
under tensor parallel); under full fine-tuning the reference scores every pair once before training
(`reference_pass_time`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .dtypes import state_bytes_per_parameter
from .hardware import (
    CPU_OPTIMIZER_PARAMS_PER_S,
    DEFAULT_GPU,
    DEFAULT_MFU,
    GPUS_PER_MACHINE,
    HOST_LINK,
    NETWORK,
    Gpu,
    collective_bandwidth,
    describe_link,
    gpu,
)
from .peak import _unsharded_bytes
from .resident import OFFLOADED, Stage, _stage_parameters, hybrid_shard_size, resident_bytes
from .shapes import EXPERT_LINEARS, ModelShape, lora_parameters, lora_parameters_per_layer
from .strategies import DEEPSPEED, _check, tensor_parallel_size

# Bytes AdamW reads and writes per trained parameter in a step: fp32 weight and m, v read and
# written (2 x 12), the fp32 gradient read (4).
OPTIMIZER_BYTES_TOUCHED = 28
# QLoRA dequantises each 4-bit weight before its matmul: reads the packed 0.5 B, writes 2 B of bf16.
DEQUANTISE_BYTES = 2.5


@dataclass(frozen=True)
class Machine:
    """The GPUs a plan is timed on: the card, the bus bandwidth (GB/s) of collectives within a machine,
    the share of the dense peak the matmuls sustain (`mfu`), and how many GPUs a machine holds: a
    collective over more ranks than that crosses the network between machines (`network_gb_s`)."""

    gpu: Gpu
    bandwidth_gb_s: float
    mfu: float = DEFAULT_MFU
    link: str = ""
    gpus_per_machine: int = GPUS_PER_MACHINE
    network_gb_s: float = NETWORK

    @classmethod
    def of(cls, name: str = DEFAULT_GPU, interconnect: str | None = None, bandwidth_gb_s: float | None = None,
           mfu: float = DEFAULT_MFU, gpus_per_machine: int = GPUS_PER_MACHINE,
           network_gb_s: float = NETWORK) -> "Machine":
        """The machine of GPU `name` (a key of `GPUS`) over `interconnect` (None: the card's usual link;
        network: one GPU per machine); `bandwidth_gb_s` replaces the link's assumed bus bandwidth and
        `network_gb_s` the network's (measured nccl-tests busbw)."""
        card = gpu(name)
        if not 0 < mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], not {mfu}")
        bandwidth = collective_bandwidth(card, interconnect) if bandwidth_gb_s is None else bandwidth_gb_s
        if bandwidth <= 0 or network_gb_s <= 0:
            raise ValueError(f"bandwidths must be > 0 GB/s, not {min(bandwidth, network_gb_s)}")
        if gpus_per_machine < 1:
            raise ValueError(f"GPUs per machine must be >= 1, not {gpus_per_machine}")
        if interconnect == "network":
            gpus_per_machine, network_gb_s = 1, bandwidth
        return cls(card, bandwidth, mfu, describe_link(card, interconnect), gpus_per_machine, network_gb_s)

    def peak_flops(self, precision: str) -> float:
        return (self.gpu.bf16_tflops if precision == "bf16" else self.gpu.fp32_tflops) * 1e12

    def bandwidth_for(self, ranks: int) -> float:
        """GB/s of a collective over `ranks` GPUs: within one machine, or across the network."""
        return self.bandwidth_gb_s if ranks <= self.gpus_per_machine else min(self.bandwidth_gb_s, self.network_gb_s)

    def seconds(self, byte_count: float, ranks: int) -> float:
        """Seconds to move `byte_count` bytes per GPU in a collective over `ranks` GPUs."""
        return byte_count / (self.bandwidth_for(ranks) * 1e9)


def active_matmul_parameters(shape: ModelShape) -> tuple[int, int]:
    """(block weights a token multiplies by, over all layers; lm_head's vocab x hidden). A mixture of
    experts counts the experts a token is routed to (`experts_per_token`), the shared one and the router."""
    shapes = shape.linear_shapes()
    attention = sum(i * o for name, (i, o) in shapes.items() if name not in EXPERT_LINEARS)
    mlp = sum(i * o for name, (i, o) in shapes.items() if name in EXPERT_LINEARS)
    routed = shape.experts_per_token if shape.experts else 1
    shared = sum(i * o for i, o in shape.shared_shapes().values())
    per_layer = attention + mlp * routed + shared + shape.hidden * shape.experts
    return per_layer * shape.layers, shape.vocab * shape.hidden


def recomputed_share(shape: ModelShape, gradient_checkpointing: int) -> float:
    """The share of blocks whose forward runs again in the backward (every Nth: ceil(layers / N))."""
    if not gradient_checkpointing:
        return 0.0
    return math.ceil(shape.layers / int(gradient_checkpointing)) / shape.layers


def flops_per_token(shape: ModelShape, method: str, seq_len: int, gradient_checkpointing: int = 0,
                    lora_rank: int = 16, lora_targets="all-linear") -> dict:
    """{"forward", "backward", "recompute", "total"} FLOPs for one token of a training step, and
    "base_forward": the forward of the model without adapters (a preference reference's)."""
    blocks, head = active_matmul_parameters(shape)
    attention = 4 * shape.layers * seq_len * shape.heads * shape.head_dim
    forward = 2 * (blocks + head) + attention
    if method == "full":
        backward = 2 * forward
        adapter_forward = 0
    else:
        adapters = lora_parameters(shape, lora_rank, lora_targets)
        adapter_forward = 2 * lora_parameters_per_layer(shape, lora_rank, lora_targets) * shape.layers
        forward += 2 * adapters
        backward = 2 * (blocks + head) + 2 * attention + 4 * adapters
    # torch's checkpoint stops recomputing once the tensors the backward needs are back: in full
    # fine-tuning a block's last linear (down_proj) is not run again; under LoRA its adapter, which
    # runs after it, still needs recomputing.
    routed = shape.experts_per_token if shape.experts else 1
    down = 0 if method != "full" else shape.layers * (math.prod(shape.linear_shapes()["down_proj"]) * routed
                                                      + math.prod(shape.shared_shapes().get("down_proj", (0, 0))))
    recompute = recomputed_share(shape, gradient_checkpointing) * (2 * (blocks - down) + attention + adapter_forward)
    return {"forward": forward, "backward": backward, "recompute": recompute,
            "total": forward + backward + recompute, "base_forward": 2 * (blocks + head) + attention}


def all_reduce(size: float, ranks: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `size` bytes."""
    return 2 * (ranks - 1) / ranks * size if ranks > 1 else 0.0


def gather(size: float, ranks: int) -> float:
    """Bytes each rank receives in a ring all-gather (or sends in a reduce-scatter) of `size` bytes in all."""
    return (ranks - 1) / ranks * size if ranks > 1 else 0.0


def data_parallel_size(strategy: str, gpus: int, pipeline_stages: int | None = None,
                       sequence_parallel: int | None = None) -> int:
    """Processes that each run their own micro-batch: all of them, except tensor parallel's groups
    (tp: 1, fsdp_tp: gpus / T), model parallel (one process), a pipeline's stages (its replicas:
    gpus / stages, one pipeline over all the GPUs by default) and sequence parallel's groups (gpus / group,
    a group of 2 by default, as sp.yaml's)."""
    if strategy == "model_parallel":
        return 1
    if strategy == "pipeline":
        return gpus // (pipeline_stages or gpus)
    if strategy == "sp":
        return gpus // (sequence_parallel or 2)
    return gpus // tensor_parallel_size(strategy, gpus)


def _gradient_bytes_reduced(method, strategy, precision, trained: int) -> float:
    """Bytes of the gradients a strategy reduces: DDP's fp32 `param.grad`; FSDP reduces in the compute
    dtype; DeepSpeed in the dtype of its gradient (`state_bytes_per_parameter`)."""
    if strategy in DEEPSPEED:
        return trained * state_bytes_per_parameter(method, strategy, precision)["trained_grad"]
    if strategy in ("ddp", "model_parallel", "pipeline"):
        return trained * 4
    return trained * (2 if precision == "bf16" else 4)


@dataclass
class Traffic:
    """Seconds of a step's collectives, by how the strategy schedules them."""

    hidden_per_micro: float = 0.0  # beside each micro-batch's compute (prefetched gathers, bucketed reductions)
    exposed_per_micro: float = 0.0  # on the critical path of each micro-batch
    hidden_per_step: float = 0.0  # behind the backward of the step's last micro-batch
    exposed_per_step: float = 0.0  # after it (ZeRO's gather of the updated weights)


def traffic(shape: ModelShape, method: str, strategy: str, gpus: int, machine: Machine, tokens: int,
            gradient_checkpointing: int = 0, lora_rank: int = 16, lora_targets="all-linear",
            precision: str = "bf16", pipeline_stages: int | None = None, reference_forward: bool = False,
            sequence_parallel: int | None = None) -> Traffic:
    """What `strategy` moves between the GPUs in a step whose micro-batches hold `tokens` tokens each
    (the module's docstring lists it per strategy; a pipeline has `pipeline_stages` stages, default one per
    GPU, replicated over the rest). `reference_forward`: each micro-batch runs one more forward, without
    gradients (a preference reference's), gathering the layers again where they are fully sharded."""
    params = _stage_parameters(shape, method, Stage(shape.layers), lora_rank, lora_targets)
    gradients = _gradient_bytes_reduced(method, strategy, precision, params["trained"])
    gathered = _unsharded_bytes(shape, method, precision, shape.layers, True, True, lora_rank, lora_targets)
    # The first unit of the forward (the embedding) and of the backward (the final norm and lm_head) is
    # gathered with nothing to compute behind it.
    first_units = sum(_unsharded_bytes(shape, method, precision, 0, embedding, not embedding, lora_rank, lora_targets)
                      for embedding in (True, False))
    c = 2 if precision == "bf16" else 4
    activation = tokens * shape.hidden * c  # one hidden state of the micro-batch
    forwards = 2 if reference_forward else 1  # (grad-op keeps the forward's gathered layers until the backward)
    seconds = machine.seconds
    if strategy == "ddp":
        return Traffic(hidden_per_step=seconds(all_reduce(gradients, gpus), gpus))
    if strategy in ("zero1", "zero2"):
        weights = params["trained"] * state_bytes_per_parameter(method, strategy, precision)["trained_weight"]
        reduce = seconds(gather(gradients, gpus), gpus)
        gather_weights = seconds(gather(weights, gpus), gpus)
        if strategy == "zero2":  # reduced bucket by bucket in every backward
            return Traffic(hidden_per_micro=reduce, exposed_per_step=gather_weights)
        return Traffic(hidden_per_step=reduce, exposed_per_step=gather_weights)
    if OFFLOADED.get(strategy, strategy) in ("fsdp_full_shard", "zero3"):
        return Traffic(hidden_per_micro=seconds(gather((forwards + 1) * gathered + gradients, gpus), gpus),
                       exposed_per_micro=seconds(gather(forwards * first_units, gpus), gpus))
    if strategy == "fsdp_grad_op":  # one gather per micro-batch: the backward's units are still gathered
        return Traffic(hidden_per_micro=seconds(gather(gathered + gradients, gpus), gpus),
                       exposed_per_micro=seconds(gather(first_units, gpus) / 2, gpus))
    if strategy == "fsdp_hybrid":
        group = hybrid_shard_size(gpus)
        return Traffic(hidden_per_micro=seconds(gather((forwards + 1) * gathered + gradients, group), group),
                       exposed_per_micro=seconds(gather(forwards * first_units, group), group),
                       hidden_per_step=seconds(all_reduce(gradients / group, gpus // group), gpus))
    if strategy in ("tp", "fsdp_tp"):
        # two all-reduces of the hidden state per block in the forward, two in the backward, two more per
        # recomputed block; lm_head's split logits gathered whole
        tp = tensor_parallel_size(strategy, gpus)
        reductions = shape.layers * (2 * forwards + 2 + 2 * recomputed_share(shape, gradient_checkpointing))
        logits = forwards * tokens * shape.vocab * c
        moved = Traffic(exposed_per_micro=seconds(reductions * all_reduce(activation, tp) + gather(logits, tp), tp))
        if strategy == "fsdp_tp":  # full shard's gathers of each rank's tensor parallel part, across the groups
            groups = gpus // tp
            moved.hidden_per_micro = seconds(gather(((forwards + 1) * gathered + gradients) / tp, groups), gpus)
            moved.exposed_per_micro += seconds(gather(forwards * first_units / tp, groups), gpus)
        return moved
    if strategy == "sp":  # zero3's gathers, and per block the attention's all-to-alls: queries, keys, values
        # in and the output back, in the forward, again in the backward and in each recomputed forward; a
        # GPU's share is its slice of the micro-batch's tokens
        group = sequence_parallel or 2
        moved = traffic(shape, method, "zero3", gpus, machine, tokens, gradient_checkpointing, lora_rank,
                        lora_targets, precision, reference_forward=reference_forward)
        exchanged = tokens / group * (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim * c
        passes = forwards + 1 + recomputed_share(shape, gradient_checkpointing)  # (a reference's: forward only)
        moved.exposed_per_micro += seconds(shape.layers * passes * gather(exchanged, group), group)
        return moved
    if strategy == "model_parallel":  # the hidden state to the next GPU, its gradient back
        return Traffic(exposed_per_micro=seconds((forwards + 1) * (gpus - 1) * activation, gpus))
    if strategy == "pipeline":  # each stage: a micro-batch's hidden state out, its gradient back, per time slot;
        # the replicas then sum each stage's gradients, after the schedule
        stages = pipeline_stages or gpus
        return Traffic(exposed_per_micro=seconds(2 * activation, stages),
                       exposed_per_step=seconds(all_reduce(gradients / stages, gpus // stages), gpus))
    raise ValueError(f"no traffic model for {strategy!r}")


def step_time(shape: ModelShape, method: str, strategy: str, gpus: int, machine: Machine, batch_size: int = 8,
              grad_accum: int = 1, seq_len: int = 512, gradient_checkpointing: int = 0, lora_rank: int = 16,
              lora_targets="all-linear", precision: str = "bf16", pipeline_stages: int | None = None,
              pipeline_chunks: int = 1, pairs: bool = False, sequence_parallel: int | None = None) -> dict:
    """Seconds of one optimizer step, estimated (see the module's docstring), split into
    {"compute", "communication", "other", "step"} plus "idle_share" (the share of GPU time no GPU
    computes: model parallel's (n-1)/n, a pipeline's bubble), "global_batch" (sequences per step) and
    "tokens_per_s". A pipeline: `pipeline_stages` stages (default: one per GPU) of `pipeline_chunks`
    parts each (the interleaved schedule's), replicated over the rest of the GPUs. With `pairs`,
    `batch_size` counts preference pairs (the module's docstring says what they add); "global_batch" too.
    Sequence parallel: groups of `sequence_parallel` GPUs (default 2) share each micro-batch."""
    _check(method, strategy, precision)
    if pairs and strategy == "pipeline":
        raise ValueError("the preference recipes run no pipeline")
    group = (sequence_parallel or 2) if strategy == "sp" else 1
    stages = (pipeline_stages or gpus) if strategy == "pipeline" else None
    global_batch = batch_size * grad_accum * data_parallel_size(strategy, gpus, stages, group)
    rows_per_example = 2 if pairs else 1
    reference_forward = pairs and method != "full"
    tokens = batch_size * rows_per_example * seq_len
    flops = flops_per_token(shape, method, seq_len, gradient_checkpointing, lora_rank, lora_targets)
    total = flops["total"] + (flops["base_forward"] if reference_forward else 0)
    flops_per_gpu = tokens * total / tensor_parallel_size(strategy, gpus) / group
    compute = flops_per_gpu / (machine.peak_flops(precision) * machine.mfu)
    backward = compute * (flops["backward"] + flops["recompute"]) / total
    moved = traffic(shape, method, strategy, gpus, machine, tokens, gradient_checkpointing, lora_rank, lora_targets,
                    precision, stages, reference_forward, sequence_parallel=group)

    other_per_micro = 0.0
    if method == "qlora":
        quantized = _stage_parameters(shape, method, Stage(shape.layers), lora_rank, lora_targets)["quantized"]
        passes = 2 + recomputed_share(shape, gradient_checkpointing) + reference_forward
        other_per_micro += quantized * DEQUANTISE_BYTES * passes / (machine.gpu.memory_gb_s * 1e9)
    at_rest = resident_bytes(shape, method, strategy, stages or gpus, lora_rank, lora_targets, precision,
                             where="anywhere")
    local_trained = at_rest["optimizer"] / state_bytes_per_parameter(method, strategy, precision)["trained_optimizer"]
    if strategy in OFFLOADED:  # shards copied in for the forward and the backward, gradients out
        host = HOST_LINK.get(machine.gpu.pcie_gen, 20.0)
        other_per_micro += (2 * at_rest["weights"] + at_rest["gradients"]) / (host * 1e9)
        optimizer = local_trained / CPU_OPTIMIZER_PARAMS_PER_S
    else:
        optimizer = local_trained * OPTIMIZER_BYTES_TOUCHED / (machine.gpu.memory_gb_s * 1e9)

    if strategy == "pipeline":  # the stages' v parts each compute 1/(p v) of every micro-batch, in v m + p - 1 slots
        parts, slots = stages * pipeline_chunks, pipeline_chunks * grad_accum + stages - 1
        step = (slots * (compute / parts + moved.exposed_per_micro + other_per_micro / parts) + optimizer / stages
                + moved.exposed_per_step)
        return {"compute": grad_accum * compute / stages,
                "communication": slots * moved.exposed_per_micro + moved.exposed_per_step,
                "other": slots * other_per_micro / parts + optimizer / stages, "step": step,
                "idle_share": (stages - 1) / slots, "global_batch": global_batch,
                "tokens_per_s": global_batch * seq_len / step}  # (no pairs: refused above)
    micro = max(compute, moved.hidden_per_micro) + moved.exposed_per_micro + other_per_micro
    last_backward_slack = max(0.0, moved.hidden_per_step - backward)
    step = grad_accum * micro + last_backward_slack + moved.exposed_per_step + optimizer
    communication = (grad_accum * (max(0.0, moved.hidden_per_micro - compute) + moved.exposed_per_micro)
                     + last_backward_slack + moved.exposed_per_step)
    return {
        "compute": grad_accum * compute,
        "communication": communication,
        "other": grad_accum * other_per_micro + optimizer,
        "step": step,
        "idle_share": (gpus - 1) / gpus if strategy == "model_parallel" else 0.0,
        "global_batch": global_batch,
        "tokens_per_s": global_batch * rows_per_example * seq_len / step,
    }


def reference_pass_time(shape: ModelShape, strategy: str, gpus: int, machine: Machine, pairs: int,
                        seq_len: int = 512, precision: str = "bf16") -> float:
    """Seconds dpo_full.py's reference takes to score `pairs` pairs once before training: the forward of
    both rows of each, spread over the data-parallel processes (tensor parallel's groups split theirs; sequence
    parallel's ranks each score whole rows, in eval mode)."""
    forward = flops_per_token(shape, "full", seq_len)["base_forward"]
    scoring = gpus if strategy == "sp" else data_parallel_size(strategy, gpus)
    flops_per_gpu = 2 * pairs * seq_len * forward / scoring / tensor_parallel_size(strategy, gpus)
    return flops_per_gpu / (machine.peak_flops(precision) * machine.mfu)


def epoch_time(step: dict, rows: int) -> float:
    """Seconds for `rows` sequences: ceil(rows / global batch) steps."""
    return math.ceil(rows / step["global_batch"]) * step["step"]

