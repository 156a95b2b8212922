"""What the planner plans for: the strategies (each with its config file, in the order of expected
speed), the methods and the attention implementations, and the check of a request against them."""

from __future__ import annotations

import math

from .shapes import lora_target_names

# Strategy -> its config file, in the order of expected speed (fastest first); see `SPEED_ORDER`.
STRATEGIES = {
    "ddp": "accelerate_configs/ddp.yaml",
    "zero1": "accelerate_configs/zero1.yaml",
    "zero2": "accelerate_configs/zero2.yaml",
    "fsdp_grad_op": "accelerate_configs/fsdp_grad_op.yaml",
    "fsdp_hybrid": "accelerate_configs/fsdp_hybrid.yaml",
    "fsdp_full_shard": "accelerate_configs/fsdp.yaml",
    "zero3": "accelerate_configs/zero3.yaml",
    "sp": "accelerate_configs/sp.yaml",  # with parallelism_config_sp_size = its group
    "tp": "accelerate_configs/tp.yaml",
    "fsdp_tp": "accelerate_configs/fsdp_tp.yaml",
    "fsdp_offload": "accelerate_configs/fsdp_offload.yaml",
    "zero3_offload": "accelerate_configs/zero3_offload.yaml",
    "pipeline": "accelerate_configs/pipeline.yaml",  # with --pipeline-stages = the GPUs
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
# - sp: zero3 over all the GPUs, each sequence split over a group of them (DeepSpeed's Ulysses): per block,
#   all-to-alls of the attention's inputs and output in the forward and again in the backward, on the
#   critical path; zero3's gathers serve 1/group of the tokens per GPU. It divides the activations.
# - tp: no weight traffic, but two all-reduces of the activations (b*s*h each) per block in the
#   forward and two in the backward, on the critical path: fine over NVLink within a machine,
#   slow across machines. It divides what sharding does not: the activations of the split
#   projections (attention heads, the MLP's intermediate width).
# - fsdp_tp: tp within each group plus fsdp_full_shard's gathers across the groups.
# - fsdp_offload ~ zero3_offload: the same plus every parameter and gradient over PCIe and the
#   optimizer step on the CPU: several times slower.
# - pipeline: model parallel's split, the micro-batches flowing through the stages at once: only the
#   hidden states between neighbours, but each stage idles (N - 1) / (micro-batches + N - 1) of a step.
# - model_parallel: little traffic, but the layers run one GPU after the other, so only ~1/N of
#   the GPUs compute at any time.
SPEED_ORDER = tuple(STRATEGIES)
DEEPSPEED = ("zero1", "zero2", "zero3", "zero3_offload", "sp")  # sp: sp.yaml, ZeRO-3 under sequence parallel
ZERO3 = ("zero3", "zero3_offload", "sp")
FSDP = ("fsdp_full_shard", "fsdp_grad_op", "fsdp_hybrid", "fsdp_offload")
TENSOR_PARALLEL = ("tp", "fsdp_tp")
METHODS = ("full", "lora", "qlora")
# What a vision-language model trains under (the recipes refuse the others before loading:
# launching/preflight.py's VISION_STRATEGIES, one process, model parallel, DDP, FSDP and DeepSpeed without sequence
# parallel)
VISION_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp_grad_op", "fsdp_hybrid", "fsdp_full_shard", "zero3",
                     "fsdp_offload", "zero3_offload", "model_parallel")
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


def tensor_parallel_size(strategy: str, gpus: int) -> int:
    """Ranks that split each layer: all of them for tp; for fsdp_tp the larger side of the balanced
    mesh (fsdp_tp.yaml's 2 x 2 on 4 GPUs; 2 x 4 on 8, 4 x 4 on 16); 1 for every other strategy."""
    if strategy == "tp":
        return gpus
    if strategy == "fsdp_tp":
        return gpus // max(d for d in range(1, math.isqrt(gpus) + 1) if gpus % d == 0)
    return 1


# The linears transformers splits by rows (and lm_head, split by its own style): peft cannot adapt them under tp.
ROW_SPLIT = ("o_proj", "down_proj", "lm_head")


def pipeline_layouts(gpus: int, layers: int | None = None) -> list[tuple[int, int]]:
    """The (stages, parts of the layers per process) a pipeline runs on `gpus` GPUs, simplest first: one
    pipeline over all of them, then fewer stages replicated over the rest; 1F1B (one part), then the
    interleaved schedule's 2 parts (the recipes' --pipeline-chunks default) where the layers allow."""
    return [(stages, chunks) for stages in range(gpus, 1, -1) if gpus % stages == 0
            for chunks in (1, 2) if layers is None or stages * chunks <= layers]


def group_splits_heads(size: int, heads: int, kv_heads: int) -> bool:
    """Whether DeepSpeed's Ulysses splits a model's heads over a sequence parallel group of `size`: the group
    divides the attention heads, and the key-value heads or is divided by them (it replicates those)."""
    return heads % size == 0 and (kv_heads % size == 0 or size % kv_heads == 0)


def sequence_layouts(gpus: int, shape=None) -> list[int]:
    """The group sizes sequence parallel runs on `gpus` GPUs, smallest first: 2 or more, dividing the GPUs,
    that split the model's heads (`group_splits_heads`)."""
    return [size for size in range(2, gpus + 1) if gpus % size == 0
            and (shape is None or group_splits_heads(size, shape.heads, shape.kv_heads))]


def check_pipeline_layout(gpus: int, stages: int, chunks: int, layers: int | None = None) -> None:
    if (stages, chunks) not in pipeline_layouts(gpus, layers):
        raise ValueError(f"a pipeline of {stages} stages x {chunks} part(s) does not run on {gpus} GPUs"
                         + (f" and {layers} layers" if layers else ""))


def impossible(method: str, strategy: str, gpus: int, shape=None, lora_targets="all-linear") -> str | None:
    """Why the recipes refuse `method` under `strategy` on `gpus` GPUs (None: they run it)."""
    if shape is not None and shape.reads_images and strategy not in VISION_STRATEGIES:
        return f"the recipes train a vision-language model under DDP, ZeRO, FSDP or model parallel, not {strategy}"
    if strategy == "pipeline":
        if gpus < 2:
            return "pipeline needs 2 GPUs or more (one stage each)"
        if not pipeline_layouts(gpus, shape.layers if shape is not None else None):
            return f"no pipeline of 2 to {shape.layers} stages divides {gpus} GPUs"
        return None
    if strategy == "sp":
        if gpus < 2:
            return "sequence parallel needs 2 GPUs or more (a group)"
        if not sequence_layouts(gpus, shape):
            return f"no group of 2 to {gpus} GPUs divides {shape.heads} attention heads"
        return None
    if strategy not in TENSOR_PARALLEL:
        return None
    tp = tensor_parallel_size(strategy, gpus)
    if tp < 2 or (strategy == "fsdp_tp" and gpus // tp < 2):
        return f"{strategy} needs {'2' if strategy == 'tp' else '4'} GPUs or more"
    if method == "qlora":
        return "4-bit weights cannot be split by tensor parallel"
    if method == "lora" and strategy == "fsdp_tp":
        return "LoRA runs tp.yaml or fsdp.yaml, not FSDP x TP"
    if method == "lora":
        row = [name for name in lora_target_names(lora_targets) if name in ROW_SPLIT]
        if row:
            return f"LoRA under tensor parallel adapts only column-split linears, not {', '.join(row)}"
    if shape is not None and math.gcd(shape.heads, shape.kv_heads) % tp:
        return f"{shape.kv_heads} key-value heads do not split {tp} ways"
    return None


def possible_strategies(method: str, gpus: int, shape=None, lora_targets="all-linear") -> tuple[str, ...]:
    """The strategies of `SPEED_ORDER` the recipes run for `method` on `gpus` GPUs."""
    return tuple(s for s in SPEED_ORDER if impossible(method, s, gpus, shape, lora_targets) is None)


# What one GPU is launched with: ddp.yaml as a single process, or an offload config, which moves the
# training state to CPU RAM. ZeRO and FSDP's sharding divide the state among the ranks, and one rank
# divides nothing; model parallel over one GPU is that same single process.
ONE_GPU = ("ddp", "fsdp_offload", "zero3_offload")


def offered_strategies(method: str, gpus: int, shape=None, lora_targets="all-linear",
                       pairs: bool = False) -> tuple[str, ...]:
    """The strategies the planner weighs for `method` on `gpus` GPUs: those the recipes run
    (`possible_strategies`; with `pairs`, the preference recipes, which run no pipeline), on one GPU only
    those of `ONE_GPU`."""
    return tuple(s for s in possible_strategies(method, gpus, shape, lora_targets)
                 if (gpus > 1 or s in ONE_GPU) and not (pairs and s == "pipeline"))


def uneven_global_batch(global_batch: int, ranks: int) -> str | None:
    """Why `--global-batch-size global_batch` cannot run on `ranks` data-parallel processes, naming the
    nearest that can (None: each process takes global_batch / ranks rows). The recipes refuse with it."""
    if global_batch % ranks == 0:
        return None
    lower, upper = global_batch // ranks * ranks, (global_batch // ranks + 1) * ranks
    return (f"--global-batch-size {global_batch} does not split over {ranks} data-parallel processes; use "
            f"{upper}{f' or {lower}' if lower else ''}")
