"""Host RAM the weights need while they load, per machine (`load_bytes_per_machine`).

Before a GPU holds anything, the weights pass through host RAM. How many copies do depends on the
strategy (measured on CPU processes, results/2026-11-27_cpu_load-memory):

- one copy a machine: FSDP with `fsdp_cpu_ram_efficient_loading` (every config here sets it: each process
  reads its shards from the files, or where they do not allow it the main process reads and sends them), ZeRO-3
  with `zero3_init_flag` (on unless a config turns it off: the main process reads, the others get their
  partitions), tensor parallel (each process reads its slices), pipeline (each stage
  reads its layers), model parallel (one process), QLoRA on GPUs (each process quantizes on its GPU
  as the weights load, a tensor at a time; the processes share the file's pages: not yet measured on a GPU);
- one copy a process: DDP and ZeRO-1/2 (each process loads its replica on the CPU, then moves it),
  FSDP or ZeRO-3 with its switch off, and QLoRA on CPU processes (each quantizes its own 4-bit copy in host RAM as the weights load).

The bytes are the weights in the dtype they load in: 2 per parameter for a frozen bf16 base, 4 for
full fine-tuning's fp32 trained weights (2 under DeepSpeed's bf16; 4 in any fp32 run), NF4 for QLoRA's quantized linears; a
vision-language model's vision tower and projector (`VisionShape`) in the dtype of its other floats (never quantized). Each
process also holds its libraries (about 0.6 GiB on a CPU process, measured), not counted here.
"""

from __future__ import annotations

from .dtypes import quantized_bytes_per_weight
from .resident import Stage, _stage_parameters
from .shapes import ModelShape
from .strategies import DEEPSPEED, FSDP, TENSOR_PARALLEL, ZERO3
from .vision import VisionShape

ONE_COPY_A_MACHINE = (*FSDP, *ZERO3, *TENSOR_PARALLEL, "pipeline", "model_parallel")


def processes_per_machine(strategy: str, gpus: int, gpus_per_machine: int) -> int:
    """Processes on the busiest machine: model parallel is one process whatever its GPUs."""
    return 1 if strategy == "model_parallel" else max(1, min(gpus, gpus_per_machine))


def model_bytes_as_loaded(shape: ModelShape, method: str, precision: str = "bf16", strategy: str | None = None,
                          vision: VisionShape | None = None) -> int:
    """One copy of the weights as they arrive in host RAM (DeepSpeed's mixed precision loads even the trained
    weights in 16 bits: its optimizer keeps their float32 masters), a vision-language model's `vision` side with
    them."""
    float_bytes = 4 if precision == "fp32" or (method == "full" and strategy not in DEEPSPEED) else 2
    # the files hold the base (LoRA's adapters start in memory: the rank and targets do not matter here)
    held = _stage_parameters(shape, method, Stage(shape.layers), lora_rank=1, lora_targets="all-linear")
    floats = held["trained"] if method == "full" else held["frozen"]
    floats += vision.tower + vision.projector + vision.unread if vision is not None else 0
    return int(floats * float_bytes + held["quantized"] * quantized_bytes_per_weight())


def load_bytes_per_machine(shape: ModelShape, method: str, strategy: str, gpus: int, gpus_per_machine: int = 8,
                           precision: str = "bf16", every_process_reads: bool = False,
                           fsdp_reads_shards: bool = True, on_gpu: bool = True,
                           vision: VisionShape | None = None) -> dict:
    """Host RAM the weights take while they load on the busiest machine: `bytes`, the `copies` of the
    model that makes, the `processes` there, `why` in words a start-up line can print, and `one_copy`:
    the change that makes it one copy a machine (None where there is none). `every_process_reads`: the
    config turned FSDP's or ZeRO-3's one-copy loading off. `vision`: a vision-language model's tower and projector."""
    processes = processes_per_machine(strategy, gpus, gpus_per_machine)
    copy = model_bytes_as_loaded(shape, method, precision, strategy, vision)
    one_copy = None  # what would make it one copy a machine
    if method == "qlora" and on_gpu:
        copy = model_bytes_as_loaded(shape, "lora", precision, vision=vision)  # the files' pages (bf16), shared
        copies, why = 1, "each process quantizes on its GPU as the weights load"
    elif method == "qlora":
        copies, why = processes, "each process quantizes its own copy in host RAM as the weights load"
    elif strategy in (*FSDP, *ZERO3) and every_process_reads:
        copies, why = processes, "every process reads the whole model"
        one_copy = "set {} in the config".format("fsdp_cpu_ram_efficient_loading: true" if strategy in FSDP
                                                 else "zero3_init_flag: true")
    elif strategy in ONE_COPY_A_MACHINE:
        copies, why = 1, {"tp": "each process reads its slices", "fsdp_tp": "each process reads its slices",
                          "pipeline": "each stage reads its layers", "model_parallel": "one process"}.get(
            strategy, "each process reads its shards from the files" if strategy in FSDP and fsdp_reads_shards
            else "one process reads, the others receive their shards")
    else:
        copies, why = processes, "each process loads its replica on the CPU before moving it"
        one_copy = "use fsdp.yaml or zero3.yaml (one process reads)"
    if processes == 1 and method != "qlora":
        copies, why, one_copy = 1, "one process", None
    return {"bytes": int(copies * copy), "copies": copies, "processes": processes, "why": why, "one_copy": one_copy}
