"""What `accelerate launch` asked for, worked out once.

The launcher tells a process its strategy through environment variables (ACCELERATE_USE_FSDP,
FSDP_RESHARD_AFTER_FORWARD, the DeepSpeed config, WORLD_SIZE, ...). `describe()` reads them once,
after `launch_config.adapt_launch` has checked and translated the user's config file, into a
`Launch`; everything that depends on the strategy reads that object: the Accelerator's set-up
(runtime), the checks and the memory plan (preflight), how the model is loaded (modeling), sample
generation (report) and run.json (runlog).

It says what was asked for. What ran, as the prepared objects report it (DeepSpeed's engine, the
FSDP plugin, each rank's shards), is recorded separately in run.json's `strategy`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
from accelerate.utils import str_to_bool

from ..refusal import refuse
from .deepspeed_config import deepspeed_source

# launch.kind values
SINGLE = "single"  # one process on one device (CPU, or one GPU)
MODEL_PARALLEL = "model_parallel"  # one process, the layers spread over the visible GPUs
DDP = "ddp"
FSDP = "fsdp"
DEEPSPEED = "deepspeed"
TENSOR_PARALLEL = "tensor_parallel"  # layers split across a group of GPUs; with FSDP over the groups when there are several

# launch.loading values: how FSDP's shards and ZeRO-3's partitions get their weights
READS_SHARDS = "each process reads its shards"  # from the files, after accelerator.prepare (model.shard_loading)
# fsdp_cpu_ram_efficient_loading / zero3_init_flag (on unless a config turns it off): FSDP's through accelerate
# in accelerator.prepare, ZeRO-3's as the model loads (modeling.partition_for_zero3)
MAIN_PROCESS_SENDS = "the main process reads and sends the shards"
EVERY_PROCESS_READS = "every process reads the whole model"  # either switch off


@dataclass(frozen=True)
class Launch:
    kind: str  # one of the names above
    processes: int  # ranks in the whole job
    on_gpu: bool
    visible_gpus: int  # GPUs this process sees
    precision: str  # mixed precision of the forward: "no", "bf16" or "fp16" (DeepSpeed: its config's)
    zero_stage: int | None = None  # DeepSpeed
    reshard_after_forward: bool | None = None  # FSDP: True = full shard, False = shard grads and optimizer only
    replicas: int = 1  # FSDP hybrid shard: groups that each hold a full copy of the shards
    offload_parameters: bool = False  # FSDP CPU offload, ZeRO-3 offload_param
    offload_optimizer: bool = False  # ZeRO offload_optimizer
    tensor_parallel: int = 1  # ranks that split each layer's weights (and see the same batches)
    pipeline_stages: int = 1  # --pipeline-stages: ranks that each run a part of the layers on the same batches
    pipeline_chunks: int = 1  # parts of the layers each of them runs (the interleaved schedule's --pipeline-chunks)
    # DeepSpeed's sequence parallel (ALST / Ulysses, parallelism_config_sp_size): ranks that each hold a slice of
    # every sequence of the same micro-batches, and the attention implementation that runs on the gathered heads
    sequence_parallel: int = 1
    sequence_attention: str | None = None
    # FSDP and ZeRO-3: one of the loadings above (None: transformers' own, ZeRO-3's 4-bit weights).
    # fsdp_cpu_ram_efficient_loading asks for one copy of the weights in host RAM: each process reads its
    # shards where the model's files allow it (settle.settle_loading), else the main process reads them and
    # sends each its shards in accelerator.prepare; zero3_init_flag asks the same of ZeRO-3
    loading: str | None = None
    # FSDP: fsdp_state_dict_type FULL_STATE_DICT, checkpoints in gathered whole files (else sharded folders)
    full_state_dict: bool = False

    @property
    def reads_shards(self) -> bool:
        return self.loading == READS_SHARDS

    @property
    def main_process_loads(self) -> bool:
        return self.loading == MAIN_PROCESS_SENDS

    @property
    def every_process_reads(self) -> bool:
        return self.loading == EVERY_PROCESS_READS

    @property
    def autocasts(self) -> bool:
        """The forward runs under accelerate's autocast (pipeline stages: under the same, training/pipeline.py):
        mixed precision, but not under DeepSpeed, which casts the weights themselves."""
        return self.precision in ("bf16", "fp16") and self.kind != DEEPSPEED

    @property
    def casts_weights(self) -> bool:
        """Mixed precision the DeepSpeed way: the weights themselves in 16 bits (their float32 masters in the
        optimizer), no autocast."""
        return self.precision in ("bf16", "fp16") and self.kind == DEEPSPEED

    @property
    def spreads_layers(self) -> bool:
        """Model parallel: one process, the layers spread over the GPUs it sees (the model loads so)."""
        return self.kind == MODEL_PARALLEL

    @property
    def shards_parameters(self) -> bool:
        """Each rank stores a part of every (tensor parallel: every split) parameter (FSDP, ZeRO-3, TP)."""
        return self.kind in (FSDP, TENSOR_PARALLEL) or (self.kind == DEEPSPEED and self.zero_stage == 3)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that each train on their own micro-batches: all of them, except that the ranks of a
        tensor parallel group, of a pipeline, or of a sequence parallel group share theirs."""
        return self.processes // self.tensor_parallel // self.pipeline_stages // self.sequence_parallel

    @property
    def gpus(self) -> int:
        """The devices one copy of the run spans: the processes, or model parallel's GPUs."""
        return self.visible_gpus if self.kind == MODEL_PARALLEL else self.processes

    def float_dtype(self, frozen: bool) -> torch.dtype:
        """Trained weights stay fp32 (autocast runs the maths in 16 bits); frozen ones may be 16-bit. Under
        DeepSpeed's mixed precision every weight is 16-bit (its optimizer keeps the float32 masters): ZeRO-3's
        zero.Init keeps the dtype the model is built in, so a float32 build would run its forward in float32."""
        if (frozen or self.casts_weights) and self.precision == "bf16":
            return torch.bfloat16
        if (frozen or self.casts_weights) and self.precision == "fp16":
            return torch.float16
        return torch.float32

    @property
    def planner_strategy(self) -> str:
        """The name `scripts/plan.py` gives this strategy (one per file in accelerate_configs/)."""
        if self.pipeline_stages > 1:
            return "pipeline"
        if self.kind == TENSOR_PARALLEL:
            return "tp" if self.data_parallel_size == 1 else "fsdp_tp"
        if self.kind == DEEPSPEED and self.sequence_parallel > 1 and self.zero_stage == 3:
            return "sp"  # sp.yaml (ZeRO-1 and 2 under sequence parallel plan as their stage at a slice's length)
        if self.kind == DEEPSPEED:
            return "zero3_offload" if self.zero_stage == 3 and self.offload_parameters else f"zero{self.zero_stage}"
        if self.kind == FSDP:
            if self.offload_parameters:
                return "fsdp_offload"
            if self.replicas > 1:
                return "fsdp_hybrid"
            return "fsdp_full_shard" if self.reshard_after_forward else "fsdp_grad_op"
        return MODEL_PARALLEL if self.kind == MODEL_PARALLEL else "ddp"

    @property
    def name(self) -> str:
        """How the run's first lines and its model card name the strategy."""
        if self.kind == TENSOR_PARALLEL:
            groups = f"FSDP over {self.data_parallel_size} groups x " if self.data_parallel_size > 1 else ""
            return f"{groups}{self.tensor_parallel}-way tensor parallel"
        if self.pipeline_stages > 1:
            return f"{self.pipeline_stages}-stage pipeline x {self.data_parallel_size} replica(s)"
        if self.sequence_parallel > 1:
            return f"zero{self.zero_stage} x {self.sequence_parallel}-way sequence parallel"
        return self.planner_strategy

    def as_record(self) -> dict:
        return {**asdict(self), "shards_parameters": self.shards_parameters, "name": self.name,
                "main_process_loads": self.main_process_loads}


def flag(env, name: str) -> bool:
    return env.get(name, "false").lower() == "true"


def number(env, name: str, default: int = 1) -> int:
    value = env.get(name, str(default))
    if not value.lstrip("-").isdigit():
        refuse(f"{name.lower()} must be a whole number, got {value!r}; fix it in the accelerate config")
    return int(value)


def tensor_parallel_size(env) -> int:
    if not flag(env, "ACCELERATE_USE_PARALLELISM_CONFIG"):
        return 1
    return number(env, "PARALLELISM_CONFIG_TP_SIZE")


def sequence_parallel_size(env) -> int:
    if not flag(env, "ACCELERATE_USE_PARALLELISM_CONFIG"):
        return 1
    return number(env, "PARALLELISM_CONFIG_SP_SIZE")


def sequence_attention(env) -> str | None:
    """parallelism_config_sp_attn_implementation as the launcher passed it (None where the file names none)."""
    value = env.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION", "None")
    return None if value == "None" else value


def describe(env=None, on_gpu: bool | None = None) -> Launch:
    """The launch described by `env` (default: this process's environment, as adapt_launch left it)."""
    env = os.environ if env is None else env
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    visible = torch.cuda.device_count() if on_gpu else 0
    common = dict(processes=int(env.get("WORLD_SIZE", "1")), on_gpu=on_gpu, visible_gpus=visible,
                  precision=env.get("ACCELERATE_MIXED_PRECISION", "no"))
    tensor_parallel = tensor_parallel_size(env)
    if tensor_parallel > 1:  # alone (tp.yaml) or with FSDP across the groups (fsdp_tp.yaml)
        return Launch(TENSOR_PARALLEL, **common, tensor_parallel=tensor_parallel)
    if flag(env, "ACCELERATE_USE_DEEPSPEED"):
        zero = deepspeed_source(env)[1]["zero_optimization"]
        stage = int(zero.get("stage", 0))
        # read as accelerate's DeepSpeedPlugin reads it (absent: on for stage 3)
        one_copy = str_to_bool(env.get("ACCELERATE_DEEPSPEED_ZERO3_INIT", "true")) == 1
        sequence = sequence_parallel_size(env)
        return Launch(DEEPSPEED, **common, zero_stage=stage, sequence_parallel=sequence,
                      sequence_attention=sequence_attention(env) if sequence > 1 else None,
                      loading=(MAIN_PROCESS_SENDS if one_copy else EVERY_PROCESS_READS) if stage == 3 else None,
                      offload_parameters=(zero.get("offload_param") or {}).get("device", "none") != "none",
                      offload_optimizer=(zero.get("offload_optimizer") or {}).get("device", "none") != "none")
    if flag(env, "ACCELERATE_USE_FSDP"):
        return Launch(FSDP, **common, offload_parameters=flag(env, "FSDP_OFFLOAD_PARAMS"),
                      loading=MAIN_PROCESS_SENDS if flag(env, "FSDP_CPU_RAM_EFFICIENT_LOADING") else EVERY_PROCESS_READS,
                      reshard_after_forward=env.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() != "false",
                      replicas=int(env.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1")),
                      # as accelerate's plugin reads it (absent: sharded, FSDP2's default)
                      full_state_dict=env.get("FSDP_STATE_DICT_TYPE", "").upper() in ("FULL_STATE_DICT", "1"))
    if common["processes"] > 1:
        return Launch(DDP, **common)
    return Launch(MODEL_PARALLEL if visible > 1 else SINGLE, **common)
