"""--eval-tasks: which lm-evaluation-harness tasks a run scores, checked before the model loads.

The flag takes task or group names as lm-eval knows them (`arc_easy,hellaswag`), paths to task YAML files
or folders of them (the user's own tasks; data/eval_tasks holds the bundled rows as two tasks), or both,
comma-separated. A task whose data is not on the machine is refused here, offline, with the command that
downloads it. lm-eval is optional: imported only when the flag is given.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from ..refusal import refuse

LM_EVAL_PIN = "lm-eval==0.4.13"
# The launches whose every rank holds the whole model's output for its own rows: each data-parallel rank scores
# its share of the requests. Tensor, pipeline and sequence parallel split one row's work over ranks.
SCORED_KINDS = ("single", "model_parallel", "ddp", "fsdp", "deepspeed")


@dataclass(frozen=True)
class EvalTasks:
    names: tuple[str, ...]  # what lm-eval is asked for
    include_path: tuple[str, ...]  # folders of the user's task YAMLs, indexed beside lm-eval's own


def parse(spec: str) -> EvalTasks:
    """The flag's items: a path that exists is a task file or folder, anything else a task or group name."""
    names, folders = [], []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        path = Path(item)
        if path.suffix in (".yaml", ".yml") or path.is_dir():
            if not path.exists():
                refuse(f"--eval-tasks {item}: no such file or folder; give a task YAML, a folder of them, or a "
                       "task name (`lm_eval ls tasks` lists them)")
            files = [path] if path.is_file() else sorted([*path.glob("*.yaml"), *path.glob("*.yml")])
            task_names = [name for file in files for name in tasks_in(file)]
            if not task_names:
                refuse(f"--eval-tasks {item}: no `task:` in {'it' if path.is_file() else 'its YAML files'}; "
                       "an lm-eval task file names its task with `task: NAME`")
            names += task_names
            folders.append(str((path.parent if path.is_file() else path).resolve()))
        else:
            names.append(item)
    return EvalTasks(tuple(dict.fromkeys(names)), tuple(dict.fromkeys(folders)))


def tasks_in(file: Path) -> list[str]:
    """The task (or group) names a task YAML defines; lm-eval's own tags (`!function`) read as nothing."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        config = yaml.load(file.read_text(), Loader=Loader) or {}
    except yaml.YAMLError as error:
        refuse(f"--eval-tasks {file}: not YAML ({str(error).splitlines()[0]})")
    if not isinstance(config, dict):
        return []
    named = [config.get("task"), config.get("group")]
    return [name for name in named if isinstance(name, str)][:1]  # a group's file names it by `group`


def check(run, launch) -> EvalTasks | None:
    """The run's tasks, or None without --eval-tasks; refuses what cannot be scored, in one line."""
    if not run.eval_tasks:
        return None
    from importlib.util import find_spec

    if find_spec("lm_eval") is None:
        refuse(f"--eval-tasks needs lm-evaluation-harness: `pip install {LM_EVAL_PIN}`, or drop --eval-tasks")
    if launch.kind not in SCORED_KINDS or launch.pipeline_stages > 1 or launch.sequence_parallel > 1:
        refuse("--eval-tasks scores under one process, model parallel, DDP, FSDP and DeepSpeed; under tensor, pipeline "
               "or sequence parallel drop it and score the merged model after training (--merge, then "
               "`lm_eval --model hf --model_args pretrained=OUTPUT_DIR/merged --tasks ...`)")
    if run.eval_limit is not None and run.eval_limit <= 0:
        refuse(f"--eval-limit {run.eval_limit}: give the rows a task scores, 1 or more (or leave it out: all)")
    tasks = parse(run.eval_tasks)
    check_offline(tasks)
    return tasks


def check_offline(tasks: EvalTasks) -> None:
    """Every task known to lm-eval and its data on this machine: loaded with the hub switched off."""
    from unittest import mock

    import datasets
    import huggingface_hub.constants
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notices on loading a task: nothing to act on here
    manager = TaskManager(include_path=list(tasks.include_path) or None)
    known = set(manager.all_tasks)
    unknown = [name for name in tasks.names if name not in known]
    if unknown:
        refuse(f"--eval-tasks: lm-eval has no task or group named {', '.join(unknown)}; `lm_eval ls tasks` lists "
               "them, or give the path of your task YAML")
    for name in tasks.names:
        with mock.patch.object(datasets.config, "HF_HUB_OFFLINE", True), \
                mock.patch.object(huggingface_hub.constants, "HF_HUB_OFFLINE", True):
            try:
                manager.load([name])
            except Exception as error:  # noqa: BLE001 - datasets raises several kinds for a missing dataset
                found = re.search(r"'([\w.-]+/[\w.-]+)'", str(error))  # the hub id in datasets' message
                source = f" ({found.group(1)})" if found else ""
                refuse(f"--eval-tasks {name}: its data{source} is not on this machine; download it once where the "
                       f"hub is reachable: `lm_eval --model dummy --tasks {name} --limit 1`")
