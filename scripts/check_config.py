#!/usr/bin/env python
"""Will my accelerate config file run these recipes? Checked here, before renting the GPUs.

Reads the file the way `accelerate launch` does (accelerate's own parser), then runs the
recipe's start-up checks on it without loading a model: prints what the recipe would translate
(FSDP1 -> FSDP2, DeepSpeed values taken over as flags), its memory plan, and `ok`, or the one-line
refusal the launch would end with. Exit status 0 = runs, 2 = refused.

Examples:
    python scripts/check_config.py my_fsdp.yaml
    python scripts/check_config.py zero3.yaml --recipe qlora --num-processes 8 --gpu -- --grad-accum 4
    python scripts/check_config.py ds_config.json        # a DeepSpeed JSON, as --deepspeed_config_file

--gpu checks as on a GPU machine (the default is what this machine has). Flags after `--` are
the recipe's own (as on `accelerate launch ... recipes/lora.py <flags>`).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from unittest import mock

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "recipes"))

from common.launching.args import (FEEDBACK_RECIPES, ONLINE_RECIPES, PREFERENCE_RECIPES,  # noqa: E402
                                   REWARD_RECIPES, answer_help_with, recipe_flags)
from common.launching.args import parse_args as parse_recipe_args  # noqa: E402


def flags() -> argparse.ArgumentParser:
    summary, _, details = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config_file", type=Path, help="an accelerate config file (.yaml or .json)")
    parser.add_argument("--recipe", choices=("full", "lora", "qlora", *PREFERENCE_RECIPES, *FEEDBACK_RECIPES, *REWARD_RECIPES,
                                                 *ONLINE_RECIPES), default="lora",
                        help="default: lora")
    parser.add_argument("--num-processes", type=int, default=None, help="as the launcher's --num_processes")
    parser.add_argument("--gpu", action="store_true", help="check as on a machine with CUDA GPUs")
    return parser


answer_help_with(flags)  # before the checks' libraries load (seconds)

from common.launching import launch_config, preflight, quick_checks  # noqa: E402
from common.launching.batch_size import settle as settle_batch  # noqa: E402
from common.launching.deepspeed_config import check_engine_config, deepspeed_source, edit_deepspeed  # noqa: E402
from common.launching.launch import DEEPSPEED, TENSOR_PARALLEL, describe  # noqa: E402


def is_deepspeed_json(path: Path) -> bool:
    """A DeepSpeed config (which `accelerate launch --deepspeed_config_file` takes), not an accelerate one:
    a .json with DeepSpeed's keys and none of accelerate's."""
    if Path(path).suffix != ".json":
        return False
    from common.launching.deepspeed_config import READ_BY_RECIPE

    config = launch_config.read_config(path)
    accelerate_keys = {"distributed_type", "compute_environment", "num_processes"}
    return not accelerate_keys & set(config) and bool(set(READ_BY_RECIPE) & set(config))


def launcher_environment(config_file: Path, num_processes: int | None = None) -> dict:
    """The environment `accelerate launch --config_file <file>` gives the first process it starts."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    if is_deepspeed_json(config_file):  # as `accelerate launch --use_deepspeed --deepspeed_config_file X`
        argv = ["--use_deepspeed", "--deepspeed_config_file", str(config_file), "--num_processes", str(num_processes or 2)]
    else:
        argv = ["--config_file", str(config_file)]
        argv += ["--num_processes", str(num_processes)] if num_processes else []
    launcher_args, defaults, precision_from_file = _validate_launch_command(
        launch_command_parser().parse_args([*argv, "recipe.py"]))
    if launcher_args.use_deepspeed:
        # as `accelerate launch` does before it calls its DeepSpeed launcher
        fields = list(defaults.deepspeed_config) if defaults and defaults.deepspeed_config else []
        launcher_args.deepspeed_fields_from_accelerate_config = ",".join(
            fields + (["mixed_precision"] if precision_from_file else []))
        env = prepare_deepspeed_cmd_env(launcher_args)[1]
    elif launcher_args.use_fsdp or launcher_args.multi_gpu:
        env = prepare_multi_gpu_env(launcher_args)
    else:
        env = prepare_simple_launcher_cmd_env(launcher_args)[1]
    processes = launcher_args.num_processes or 1
    machines = launcher_args.num_machines or 1
    distributed = launcher_args.use_deepspeed or launcher_args.use_fsdp or launcher_args.multi_gpu
    env.update(RANK="0", WORLD_SIZE=str(processes if distributed else 1),
               LOCAL_WORLD_SIZE=str(max(1, processes // machines) if distributed else 1))
    return env


def refuse_what_the_launcher_chokes_on(path: Path) -> None:
    """Files `accelerate launch` itself fails on with a traceback, before any recipe starts."""
    config = launch_config.read_config(path)  # refuses unreadable YAML / JSON in one line
    if not config:
        preflight.refuse(f"{path.name} holds no settings (empty, or not a mapping of key: value); write it with "
                         "`accelerate config`, or start from a file in accelerate_configs/")
    for key in ("distributed_type", "mixed_precision"):
        if isinstance(config.get(key), bool):  # YAML reads an unquoted NO / no as false
            preflight.refuse(f"{path.name}: {key} is read as the boolean {config[key]} (YAML turns an unquoted "
                             f"NO / no into false); write it in quotes: {key}: 'NO' / 'no'")
    kind = config.get("distributed_type")
    if isinstance(kind, str) and kind != kind.upper():  # accelerate's enum takes capitals only
        preflight.refuse(f"{path.name}: distributed_type `{kind}` must be written in capitals: "
                         f"distributed_type: {kind.upper()}")
    for key in ("num_processes", "num_machines", "machine_rank"):
        if key in config and not isinstance(config[key], int):
            preflight.refuse(f"{path.name}: {key} is {config[key]!r}; write a whole number without quotes")


# The start-up checks a preference or online recipe runs as: dpo.py, kto.py and grpo.py as LoRA (QLoRA with
# --bits), dpo_full.py, kto_full.py and grpo_full.py as full tuning.
SETTLED_AS = {"dpo": "lora", "dpo_full": "full", "kto": "lora", "kto_full": "full", "reward": "lora",
              "reward_full": "full", "grpo": "lora", "grpo_full": "full"}


def check(config_file: Path, recipe: str = "lora", recipe_argv: list[str] = (), num_processes: int | None = None,
          on_gpu: bool | None = None) -> list[str]:
    """The lines the recipe would print at start-up for this config file; raises `preflight.Refusal`."""
    path = Path(config_file)
    refuse_what_the_launcher_chokes_on(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the launcher's notes about ports in use
            env = launcher_environment(path, num_processes)
    except Exception as error:  # noqa: BLE001 - whatever stops `accelerate launch` is the answer, in one line
        # accelerate stops at an unknown top-level key without naming an alternative: name one
        problem = None if is_deepspeed_json(path) else launch_config.unknown_key(launch_config.read_config(path))
        lines = str(error).strip().splitlines() or [type(error).__name__]
        preflight.refuse(f"{path.name}: {problem}" if problem else f"accelerate cannot launch {path.name}: {lines[0]}")
    args = parse_recipe_args(recipe_flags(recipe), list(recipe_argv))
    shown = recipe  # the recipe named; the checks below run as the one it settles as
    recipe = "qlora" if recipe in ("dpo", "kto", "reward", "grpo") and args.bits else SETTLED_AS.get(recipe, recipe)
    on_gpu = (__import__("torch").cuda.is_available()) if on_gpu is None else on_gpu
    with mock.patch.dict(os.environ, env, clear=True), mock.patch("torch.cuda.is_available", return_value=on_gpu):
        run, notes = launch_config.adapt_launch(args, config_file=None if is_deepspeed_json(path) else path,
                                                on_gpu=on_gpu)
        launch = describe(on_gpu=on_gpu)
        if env["WORLD_SIZE"] == "1" and not is_deepspeed_json(path):  # as settle.settle_launch, in its order:
            config = launch_config.read_config(path)  # accelerate starts one process, whatever was asked
            asked = num_processes or int(config.get("num_processes") or 1)
            launch_config.refuse_one_process_for_several(str(config.get("distributed_type", "NO")).upper(), asked)
        quick_checks.check_ranges(run)  # values the file handed to the flags, too
        if shown in ONLINE_RECIPES:  # generation needs whole layers: no pipeline, tensor or sequence parallel
            preflight.check_online_strategy(run, launch)
        if shown in REWARD_RECIPES:  # what a reward model cannot run (packing, tp / sp / pipeline, --eval-tasks)
            preflight.check_reward_run(run, launch)
        launch = preflight.check_pipeline(run, recipe, launch)  # --pipeline-stages against the processes, the model
        preflight.check_strategy(run, recipe, launch)  # FSDP's layer classes against the model, ...
        if launch.kind == TENSOR_PARALLEL:  # what the recipe can split (its model's heads, LoRA's targets)
            preflight.check_tensor_parallel(run, recipe, launch)
        if launch.sequence_parallel > 1:  # the recipe, its model's heads, packing against the attention
            preflight.check_sequence_parallel(run, launch)
        if shown in PREFERENCE_RECIPES:  # what pairs cannot run (packing, pipeline stages, --batch-size auto)
            preflight.check_preference_run(run, launch)
        if shown in FEEDBACK_RECIPES:  # what KTO cannot run (packing, pipeline stages, sequence parallel, auto)
            preflight.check_feedback_run(run, launch)

        run, batch_line = settle_batch(run, recipe, launch)  # the file's train_batch_size must split over the ranks
        preflight.check_pipeline_micro_batches(run, launch)
        if shown in ONLINE_RECIPES:  # whole groups in the global batch; what cannot generate (tp, pipeline, sp)
            preflight.check_online_run(run, launch)
        if launch.kind == DEEPSPEED:  # as the recipe, once the Accelerator exists: the engine's exact config
            source, config, _ = deepspeed_source(os.environ)
            edit_deepspeed(config, run)
            check_engine_config(config, run, launch.precision, Path(source).name)
    lines = [f"config: {'; '.join(notes)}"] if notes else []
    lines += [batch_line] if batch_line else []
    runs_as = launch.name if launch.pipeline_stages > 1 or launch.sequence_parallel > 1 else launch.planner_strategy
    return lines + [f"ok: {shown} runs as {runs_as} on {launch.gpus} process(es), precision {launch.precision}"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    recipe_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    args = flags().parse_args(argv)
    if not args.config_file.is_file():
        print(f"error: {args.config_file} does not exist", file=sys.stderr)
        return 2
    try:
        lines = check(args.config_file, args.recipe, recipe_argv, args.num_processes, on_gpu=args.gpu or None)
    except preflight.Refusal:
        return 2  # the refusal line is already printed
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
