"""The CPU launch matrix shared by the matrix and equivalence tests: one launch per recipe x
config, reused by both (a launch costs ~15 s; the suite budgets them)."""

from __future__ import annotations

import pytest

from conftest import long_test

# config -> (distributed type seen on CPU, processes, parameters sharded across ranks?)
CPU_STRATEGIES = {
    "model_parallel": ("NO", 1, False),
    "ddp": ("MULTI_CPU", 2, False),
    "fsdp": ("FSDP", 2, True),
    "fsdp_grad_op": ("FSDP", 2, True),
    "fsdp_offload": ("FSDP", 2, True),
    "zero1": ("DEEPSPEED", 2, False),
    "zero2": ("DEEPSPEED", 2, False),
    "zero3": ("DEEPSPEED", 2, True),
    "zero3_offload": ("DEEPSPEED", 2, True),
    "sp": ("DEEPSPEED", 2, True),  # ZeRO-3 x 2-way sequence parallel: both ranks slice the same rows
}
# ranks that share their micro-batches (a sequence parallel group): the rest train on their own
SEQUENCE_PARALLEL = {"sp": 2}
RECIPES = ("full", "lora", "qlora")
# Launched by every suite run: each config with at least one recipe, each recipe with the one-process
# reference, DDP, an FSDP and a ZeRO config (15 launches). RECIPES_LONG_TESTS=1 launches all 30.
EVERY_RUN = {
    "full": ("model_parallel", "ddp", "fsdp", "zero1", "zero3"),
    "lora": ("model_parallel", "ddp", "fsdp", "fsdp_grad_op", "zero2", "zero3", "sp"),
    "qlora": ("model_parallel", "ddp", "fsdp_offload", "zero3_offload"),
}
# The sharded configs whose adapters are compared with DDP's, per recipe (all in EVERY_RUN).
SHARDED = {"lora": ("fsdp", "zero3"), "qlora": ("fsdp_offload", "zero3_offload")}
# --merge writes merged/ in a fresh process from adapter/, the same whatever the strategy: merged once per recipe.
MERGED_IN = "ddp"
# What the start-up memory plan calls each launch (model parallel on CPU: one process, no GPUs to spread over).
PLANNER_NAME = {"model_parallel": "ddp", "ddp": "ddp", "fsdp": "fsdp_full_shard", "fsdp_grad_op": "fsdp_grad_op",
                "fsdp_offload": "fsdp_offload", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3",
                "zero3_offload": "zero3_offload", "sp": "sp"}
GLOBAL_BATCH = 16  # rows per optimizer step, the same on every strategy
GRAD_ACCUM = 2
STEPS = 8
SAVE_EVERY = 4  # every launch writes checkpoints step-4 and step-8; test_resume continues from step-4


def matrix_cases(configs=tuple(CPU_STRATEGIES)) -> list:
    """(recipe, config) parameters; those outside EVERY_RUN are long tests."""
    return [pytest.param(recipe, config, marks=() if config in EVERY_RUN[recipe] else long_test)
            for recipe in RECIPES for config in configs]


def matrix_args(recipe: str, config: str) -> list[str]:
    """The same seed and global batch everywhere: the one-process launch takes the whole batch."""
    data_parallel = CPU_STRATEGIES[config][1] // SEQUENCE_PARALLEL.get(config, 1)
    args = ["--max-steps", str(STEPS), "--grad-accum", str(GRAD_ACCUM), "--log-every", "4",
            "--batch-size", str(GLOBAL_BATCH // GRAD_ACCUM // data_parallel), "--save-every", str(SAVE_EVERY)]
    if config in SEQUENCE_PARALLEL:  # README's command: a group takes rows 16 times the bundled ones' cut
        args += ["--max-length", "16384"]
    if recipe == "full":
        return args + ["--lr", "2e-3"]
    # Dropout draws differ between one process and several; without it the curves must agree.
    return args + ["--lr", "5e-3", "--lora-dropout", "0"]
