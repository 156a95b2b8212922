"""What is benchmarked: the strategies (an accelerate config and a recipe) and the reference workloads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.paths import REPO


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
