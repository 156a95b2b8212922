"""One settled run: the flags, the accelerate / DeepSpeed file and the batch rules make a new read-only
run; nothing writes to it afterwards, and every value a file or rule changed is listed with its source."""

from __future__ import annotations

import ast
import json
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
from common.launching import batch_size, launch_config  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.launching.launch import Launch  # noqa: E402
from common.launching.settled import Run  # noqa: E402


def test_a_settled_run_cannot_be_written():
    run = parse_args(recipe_flags("lora"), ["--lr", "1e-4"])
    with pytest.raises(AttributeError, match="read-only"):
        run.lr = 1e-3
    with pytest.raises(AttributeError, match="read-only"):
        setattr(run, "anything_new", 1)
    with pytest.raises(TypeError, match="not a record of a run"):
        run.recorded(hidden_field=1)
    assert run.lr == 1e-4


def test_each_settle_step_returns_a_new_run_naming_its_sources(tmp_path):
    """A DeepSpeed file's lr and accumulation, then --global-batch-size's rule: the flags as parsed stay as
    they were, and the settled run lists each changed value once, with what changed it."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5,
                                "optimizer": {"type": "AdamW", "params": {"lr": 3e-5}}}))
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path), "WORLD_SIZE": "2",
           "ACCELERATE_MIXED_PRECISION": "no"}
    parsed = parse_args(recipe_flags("lora"), ["--batch-size", "2", "--global-batch-size", "16"])
    from_file, _ = launch_config.adapt_launch(parsed, env=env, config_file=None, on_gpu=False)
    run, line = batch_size.settle(from_file, "lora", Launch("deepspeed", processes=2, on_gpu=False,
                                                             visible_gpus=0, precision="no"))
    assert (parsed.lr, parsed.max_grad_norm, parsed.grad_accum) == (2e-4, 1.0, 1)  # untouched
    assert (run.lr, run.max_grad_norm, run.grad_accum, run.batch_size) == (3e-5, 0.5, 4, 2)
    assert run.settled_from == {"lr": f"optimizer.params.lr in {path}", "max_grad_norm": f"gradient_clipping in {path}",
                                "grad_accum": "--global-batch-size 16 / (micro-batch 2 x 2 process(es))"}
    assert {"lr", "max_grad_norm"} <= set(run.given_flags) and "grad_accum" not in run.given_flags
    assert run.batch_plan == {"asked": {"batch_size": 2, "global_batch_size": 16}}
    assert line == "batch: 2 per process x --grad-accum 4 x 2 process(es) = 16 sequences per step"


def writes_to_a_run(path) -> list[str]:
    """`run.x = ...`, `args.x += ...`, `setattr(run, ...)` and `vars(args)[...] = ...` in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            holder = target.value if isinstance(target, (ast.Attribute, ast.Subscript)) else None
            if isinstance(holder, ast.Call) and getattr(holder.func, "id", None) == "vars":
                holder = holder.args[0]
            if isinstance(holder, ast.Name) and holder.id in ("args", "run"):
                found.append(f"{path.name}:{node.lineno}")
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
                and isinstance(node.args[0], ast.Name) and node.args[0].id in ("args", "run")):
            found.append(f"{path.name}:{node.lineno}")
    return sorted(found, key=lambda where: int(where.rsplit(":", 1)[1]))


def test_no_module_writes_to_the_run():
    files = sorted((REPO / "recipes").rglob("*.py"))
    assert len(files) > 20
    assert [where for path in files for where in writes_to_a_run(path)] == []


def test_the_write_finder_finds_writes(tmp_path):
    """The check above can fail: each form of write it looks for, in a file of its own."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f(args, run):\n    args.lr = 1\n    run.steps += 1\n    setattr(args, 'x', 2)\n"
                      "    vars(run)['y'] = 3\n    other.lr = 4\n")
    assert writes_to_a_run(sample) == ["sample.py:2", "sample.py:3", "sample.py:4", "sample.py:5"]


def test_a_namespace_becomes_a_run():
    import argparse

    run = Run.of(argparse.Namespace(lr=1e-4))
    assert isinstance(run, Run) and run.lr == 1e-4 and run.settled_from == {} and Run.of(run) is run
