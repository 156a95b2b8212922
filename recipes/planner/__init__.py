"""Will it fit, and which config? The memory planner behind `scripts/plan.py`.

Pure Python: no torch, no GPU. Everything is computed from the model's shape (a config.json)
and counts what the recipes really allocate on the busiest GPU, in four parts:

- weights: the parameters held on the GPU (stored shards plus the unsharded copies in flight);
- gradients: the gradients of the trained parameters (plus the communication buffers that
  mirror them);
- optimizer: AdamW's two moments (plus DeepSpeed's fp32 master copy);
- activations: what autograd keeps from the forward for the backward, the logits and the loss.

The first three build on `resident_bytes()`: what each rank keeps at rest, i.e. the local part
of every parameter, its gradient and its optimizer state as they stand when the optimizer steps.
That is what every launch measures into run.json's `memory_by_rank` (`runlog.held_bytes`), and
tests/test_plan_vs_ranks.py checks the two against each other on every strategy. The per-GPU
numbers add what is only transient: gathered layers in flight, DDP's bucket copy, DeepSpeed's
reduce bucket, ZeRO-1's unpartitioned gradients of the backward, and the NF4 constants (which
are not parameters).

`plan()` evaluates every strategy of `accelerate_configs/`, estimates its time, and recommends: on all the GPUs
the fastest that fits, or the fastest of those that have run on a GPU in this project (`evidence`) unless the
other is `CLEARLY_FASTER` by its estimate, and the one that needs the fewest GPUs.

One module per job (every public name of each is importable from `planner` itself):

- `strategies`: the strategies with their config files in the order of expected speed, the
  methods and attention implementations, the check of a request against them, those offered on one
  GPU, and the recipes' rule for splitting a global batch;
- `shapes`: `ModelShape`, `load_shape` and its offline `ALIASES` (with the `HUB_IDS` a launch loads), the
  LoRA parameter counts;
- `dtypes`: bytes per parameter at rest (the table of bytes per parameter is there) and the
  dtypes the forward computes in;
- `resident`: what each rank keeps at rest (`resident_bytes`): the part of the model a GPU runs,
  the sharding divisors, and the CPU RAM of the offload configs;
- `peak`: weights, gradients and optimizer state on the busiest GPU: resident + transient;
- `activations`: the activation bytes per token of a block and per micro-batch;
- `generation`: what a GPU holds while it samples completions (grpo.py): the whole model, the KV cache;
- `hardware`: the GPUs by name (`GPUS`: memory, peak, memory bandwidth, usual link; `gpu_key` refuses an
  unknown name naming the closest) and the bus bandwidth a collective reaches over each link;
- `evidence`: the strategies this project has run on a GPU (`RAN_ON_GPU`), the rest being estimates only;
- `timing`: the estimated seconds of a step per strategy (`step_time`) on a `Machine`: the step's
  FLOPs at an assumed share of the peak, the bytes each strategy moves, what it overlaps, and model
  parallel's idle GPUs;
- `host_load`: the host RAM the weights take while they load, per machine (`load_bytes_per_machine`);
- `vision`: a vision-language model's vision tower and projector (`VisionShape`) and what they add to a GPU
  (`vision_bytes`): weights, what trains of them, the tower's activations on a micro-batch's images;
- `choose`: the busiest GPU's total, what fits, the largest micro-batch, each strategy's fastest run
  of the asked global batch (`best_run`), and `plan()`.

Sizes are bytes; the tables print GiB (2**30). A GPU's memory is what CUDA gives of it (`gpu_memory_gib`:
torch's `total_memory` / 2**30), below the size it is sold as (`Gpu.memory_gb`: "a 48 GB L40S" gives 44.4 GiB
with its ECC on; `Gpu.memory_gib` converts).
"""

from .activations import activation_bytes, layer_activation_bytes_per_token
from .choose import (
    layout_of,
    layouts_of,
    CLEARLY_FASTER,
    HEADROOM,
    TIE,
    MARGIN,
    MAX_MICRO_BATCH,
    GiB,
    best_run,
    fastest_of,
    fits,
    global_batch_refusal,
    max_micro_batch,
    per_gpu_bytes,
    plan,
    rank_key,
    tested_beside,
    usable_bytes,
)
from .dtypes import NF4_BITS_PER_WEIGHT, compute_dtypes, quantized_bytes_per_weight, state_bytes_per_parameter
from .evidence import RAN_ON_GPU, gpu_evidence
from .generation import generation_bytes, kv_cache_bytes
from .host_load import load_bytes_per_machine, model_bytes_as_loaded, processes_per_machine
from .hardware import (
    DEFAULT_GPU,
    DEFAULT_MFU,
    GPUS,
    GPUS_PER_MACHINE,
    INTERCONNECTS,
    NETWORK,
    Gpu,
    cards_of_memory,
    collective_bandwidth,
    card_of_device,
    gpu_key,
)
from .peak import (
    DEEPSPEED_REDUCE_BUCKET,
    LAYERS_IN_FLIGHT,
    fsdp_units,
    gradient_bytes,
    in_flight_gradient_bytes,
    in_flight_weight_bytes,
    optimizer_bytes,
    quantization_constant_bytes,
    weight_bytes,
)
from .resident import (
    OFFLOADED,
    WHERE,
    Stage,
    cpu_offload_bytes,
    hybrid_shard_size,
    model_parallel_stages,
    resident_bytes,
)
from .shapes import (
    ALIASES,
    DATASET_PLACEHOLDER,
    HUB_IDS,
    LINEAR_NAMES,
    MODEL_PLACEHOLDER,
    REPO_ROOT,
    ModelShape,
    config_source,
    launch_model,
    load_shape,
    lora_parameters,
    lora_parameters_per_layer,
    lora_target_names,
)
from .strategies import (
    ATTENTIONS,
    DEEPSPEED,
    FSDP,
    METHODS,
    SPEED_ORDER,
    STRATEGIES,
    TENSOR_PARALLEL,
    ONE_GPU,
    VISION_STRATEGIES,
    impossible,
    offered_strategies,
    pipeline_layouts,
    group_splits_heads,
    possible_strategies,
    sequence_layouts,
    tensor_parallel_size,
    uneven_global_batch,
)
from .timing import Machine, data_parallel_size, epoch_time, flops_per_token, reference_pass_time, step_time
from .vision import VisionShape, vision_activation_bytes, vision_bytes, vision_kept_bytes, vision_parameters

__all__ = [
    "DEFAULT_GPU", "DEFAULT_MFU", "GPUS", "GPUS_PER_MACHINE", "INTERCONNECTS", "NETWORK", "MARGIN", "Gpu",
    "Machine", "best_run", "fastest_of", "tested_beside", "CLEARLY_FASTER", "TIE", "layout_of", "layouts_of", "pipeline_layouts", "sequence_layouts", "group_splits_heads",
    "RAN_ON_GPU", "card_of_device", "cards_of_memory", "gpu_evidence", "gpu_key",
    "collective_bandwidth", "data_parallel_size", "epoch_time", "flops_per_token", "rank_key", "step_time",
    "reference_pass_time",
    "ALIASES", "DATASET_PLACEHOLDER", "HUB_IDS", "config_source", "MODEL_PLACEHOLDER", "ONE_GPU", "global_batch_refusal", "launch_model",
    "offered_strategies", "uneven_global_batch",
    "ATTENTIONS", "DEEPSPEED", "DEEPSPEED_REDUCE_BUCKET", "FSDP", "HEADROOM", "LAYERS_IN_FLIGHT",
    "LINEAR_NAMES", "MAX_MICRO_BATCH", "METHODS", "NF4_BITS_PER_WEIGHT", "OFFLOADED", "REPO_ROOT", "SPEED_ORDER",
    "STRATEGIES", "TENSOR_PARALLEL", "VISION_STRATEGIES", "WHERE", "GiB", "ModelShape", "Stage", "activation_bytes", "compute_dtypes",
    "cpu_offload_bytes", "fits", "fsdp_units", "gradient_bytes", "hybrid_shard_size", "impossible",
    "in_flight_gradient_bytes", "in_flight_weight_bytes",
    "layer_activation_bytes_per_token", "load_shape", "lora_parameters", "lora_parameters_per_layer",
    "lora_target_names", "max_micro_batch", "model_parallel_stages", "optimizer_bytes", "per_gpu_bytes", "plan",
    "possible_strategies",
    "quantization_constant_bytes", "quantized_bytes_per_weight", "resident_bytes", "state_bytes_per_parameter",
    "tensor_parallel_size", "usable_bytes", "weight_bytes",
    "load_bytes_per_machine", "model_bytes_as_loaded", "processes_per_machine",
    "VisionShape", "vision_activation_bytes", "vision_bytes", "vision_kept_bytes", "vision_parameters",
]
