"""Everything a launch settles and checks before the model loads, in one place and one order.

The run's flags (parsed: `args.parse_args`) meet the user's accelerate or DeepSpeed file, the
batch-size rules and the model's own limits here. Each settle step returns a new read-only run
(settled.py); each check only reads and refuses (preflight.py). What comes out is the run every
later step reads, and the launch: what accelerate launch asked for.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..model.adapters import adapter_base, merged_start_model
from ..model.modeling import compile_cache_dir
from ..model.shard_loading import why_not_read_shards
from . import eval_tasks, launch_config, memory_plan, preflight, quick_checks
from .args import FEEDBACK_RECIPES, ONLINE_RECIPES, PREFERENCE_RECIPES, REWARD_RECIPES
from .batch_size import settle as settle_batch
from .launch import DDP, FSDP, READS_SHARDS, SINGLE, TENSOR_PARALLEL, Launch, describe
from .settled import Run


def say(line: str) -> None:
    """A start-up line, printed once (by the first rank)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)


def settle_launch(args: Run, recipe: str) -> tuple[Run, Launch]:
    """The settled run and the checked launch; refuses, in one line, whatever can be known to fail
    before the model loads."""
    preflight.check_versions()
    # The user's config file: it may translate the launch (FSDP1 -> FSDP2) or settle flags.
    run, notes = launch_config.adapt_launch(args)
    if notes:
        say(f"config: {'; '.join(notes)}")
    launch = describe()
    launch_config.check_process_count(launch)
    quick_checks.check_flags(run, recipe)  # (the recipe made these before loading torch: a config file may have set more)
    quick_checks.check_paths(run)  # before anything below asks the hub
    preflight.check_hub(run, adapter_base(run.model) or run.model)
    preflight.check_speed_options(run, launch.on_gpu)
    run = settle_model(run)  # a LoRA adapter as --model: its base with the adapter merged in
    if run.recipe in ONLINE_RECIPES:  # generation needs whole layers: no pipeline, tensor or sequence parallel
        preflight.check_online_strategy(run, launch)
    if run.recipe in REWARD_RECIPES:  # (before the strategies' own checks: the strategy is what to change)
        preflight.check_reward_run(run, launch)
    launch = preflight.check_pipeline(run, recipe, launch)
    preflight.check_vision_language(run, launch)  # images: the supervised recipes, the strategies run so far
    if launch.kind == TENSOR_PARALLEL:
        preflight.check_tensor_parallel(run, recipe, launch)
    if launch.sequence_parallel > 1:
        preflight.check_sequence_parallel(run, launch)
    if run.recipe in PREFERENCE_RECIPES:
        preflight.check_preference_run(run, launch)
    if run.recipe in FEEDBACK_RECIPES:
        preflight.check_feedback_run(run, launch)
    if run.recipe in ONLINE_RECIPES:
        quick_checks.check_rewards(run)  # your prompts need a reward, in a file that exists
        changes = preflight.settle_online_run(run, launch)
        run = run.settled(changes) if changes else run
    run = settle_compile(run, recipe, launch)  # (after the pipeline's stages are known)
    eval_tasks.check(run, launch)  # lm-eval's tasks: installed, known, their data on this machine
    run, batch_line = settle_batch(run, recipe, launch)  # --batch-size auto, --global-batch-size
    preflight.check_pipeline_micro_batches(run, launch)  # (after --global-batch-size has set --grad-accum)
    if run.recipe in ONLINE_RECIPES:
        preflight.check_online_run(run, launch)  # (whole groups in the global batch: after it is settled)
    if batch_line:
        say(batch_line)
    preflight.check_strategy(run, recipe, launch)

    run = settle_paths(run)
    quick_checks.check_paths(run)
    preflight.check_inputs(run)
    if recipe != "full":
        preflight.check_lora_targets(run)
        dropout = preflight.adapter_dropout(run)
        if dropout != run.lora_dropout:
            run = run.settled({"lora_dropout": (dropout, "peft (the fused expert weights take no dropout)")})
            say("lora: --lora-dropout 0 (peft's LoRA on the fused expert weights of this mixture of experts "
                "takes no dropout)")
    if recipe == "qlora":
        run = run.recorded(quantization_plan=preflight.check_quantization(run))
    preflight.check_outputs(run, recipe)
    launch = settle_loading(run, recipe, launch)
    memory_plan.announce_plan(run, recipe, launch)
    return run, launch


# Where compiling each decoder layer is on without a flag: measured on a CUDA GPU (LoRA under DDP, one H200:
# 38.7% MFU against 26.0%, the same loss within bf16's round-off; results/2026-11-28_h200_calls) or the same
# per-layer wrapping (one process, FSDP2). Not QLoRA's 4-bit layers, DeepSpeed, tensor, pipeline or sequence
# parallel, model parallel: none of them has run compiled on a GPU. Liger's kernels with it ran slower than
# compile alone (34.6% against 38.7%), so --liger keeps compile off unless asked. Compiling is the first step (25.6 s
# there, with a cold cache, against 0.40 s a compiled step and 0.59 s an eager one): repaid after ~130 steps, so a
# run planned shorter (the reference epoch: 32 steps) stays eager.
COMPILED_BY_DEFAULT = (SINGLE, DDP, FSDP)
FEWEST_COMPILED_STEPS = 100


def settle_compile(run: Run, recipe: str, launch: Launch) -> Run:
    """--compile when neither --compile, --no-compile nor a config file said: off where it was not measured to
    win; where it was, left to `settle_compile_steps`, which knows the run's planned steps."""
    if run.compile is not None:
        return run
    if (launch.on_gpu and launch.kind in COMPILED_BY_DEFAULT and recipe != "qlora" and not run.liger
            and launch.pipeline_stages == 1 and launch.sequence_parallel == 1):
        return run  # decided with the planned steps, after the data (settle_compile_steps)
    return run.settled({"compile": (False, "the default here (on only with a CUDA GPU, one process / DDP / FSDP, "
                                           "not QLoRA or --liger)")})


def settle_compile_steps(run: Run, planned_steps: int) -> Run:
    """Where compiling is on by default (settle_compile left it open): on when the run's planned steps repay
    compiling, said in one `speed:` line either way. The steps are known after the data: --max-steps, or the
    epochs over the rows."""
    if run.compile is not None:
        return run
    on = planned_steps >= FEWEST_COMPILED_STEPS
    if on:
        say(f"speed: --compile on ({planned_steps} planned steps repay compiling each decoder layer, the first step "
            f"~25 s slower; kernels cached in {compile_cache_dir()} for the next launch; --no-compile turns it off)")
        why = f"the default on a CUDA GPU under this launch: {planned_steps} planned steps"
    else:
        say(f"speed: --compile off ({planned_steps} planned steps would not repay compiling: ~25 s, repaid after "
            f"~{FEWEST_COMPILED_STEPS} steps; --compile forces it)")
        why = f"the default: {planned_steps} planned steps, fewer than the {FEWEST_COMPILED_STEPS} that repay compiling"
    return run.settled({"compile": (on, why)})


def settle_model(run: Run) -> Run:
    """A LoRA adapter folder as --model (what an SFT run saved as adapter/): the run trains its base with the
    adapter merged in, a model written once per machine (model/adapters.py), and every later check and load
    reads that model. The run records the adapter it came from in settled_from."""
    base = adapter_base(run.model)
    if base is None:
        return run
    folder, earlier = merged_start_model(run.model, base, run.trust_remote_code)
    say(f"model: {run.model} is a LoRA adapter; training its base {base} with the adapter merged in "
        f"({folder}, {'merged by an earlier run' if earlier else 'merged now, once per machine'})")
    return run.settled({"model": (str(folder), f"the LoRA adapter {run.model} merged onto its base {base}")})


def settle_loading(run: Run, recipe: str, launch: Launch) -> Launch:
    """FSDP with fsdp_cpu_ram_efficient_loading (one copy of the weights in host RAM): each process reads its
    shards from the model's files where they allow it, else the main process reads and sends them (said why).
    4-bit weights are quantized as each process loads (bitsandbytes), and a pipeline stage reads its layers;
    ZeRO-3's 4-bit weights load as transformers loads them (its zero.Init, bitsandbytes on each process)."""
    if recipe == "qlora" and launch.zero_stage == 3:
        return dataclasses.replace(launch, loading=None)
    if launch.kind != FSDP or not launch.main_process_loads or recipe == "qlora" or launch.pipeline_stages > 1:
        return launch
    why_not = ("a reward model's score head is not in the model's files" if run.recipe in REWARD_RECIPES
               else why_not_read_shards(run.model, run.trust_remote_code))
    if why_not:
        say(f"loading: the main process reads the weights and sends each process its shards, since {why_not}")
        return launch
    return dataclasses.replace(launch, loading=READS_SHARDS)


def settle_paths(run: Run) -> Run:
    """Paths as the run uses them: `~` expanded (a run file's `~/runs/x` met no shell), and a local
    model folder made absolute (the adapter's config and run.json record it; a relative path means
    nothing elsewhere)."""
    changes = {}
    output_dir = os.path.expanduser(run.output_dir)
    if output_dir != run.output_dir:
        changes["output_dir"] = (output_dir, "~ expanded")
    if Path(run.model).expanduser().exists():
        model = str(Path(run.model).expanduser().resolve())
        if model != run.model:
            changes["model"] = (model, "the local folder's absolute path")
    return run.settled(changes) if changes else run
