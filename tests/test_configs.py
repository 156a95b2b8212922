"""The configs that cannot run on CPU are still checked: they parse, they say what they are
for, and the model-parallel plan really splits a model over the GPUs it is told about."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from conftest import CONFIGS, REPO

ALL_CONFIGS = sorted(CONFIGS.glob("*.yaml"))
EXPECTED = {"model_parallel", "ddp", "fsdp", "fsdp_grad_op", "fsdp_hybrid", "fsdp_offload",
            "zero1", "zero2", "zero3", "zero3_offload", "multi_node", "tp", "fsdp_tp", "pipeline", "sp"}


def test_every_strategy_has_its_config():
    assert {path.stem for path in ALL_CONFIGS} == EXPECTED


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.stem)
def test_config_parses_and_explains_itself(path: Path):
    config = load_config_from_file(str(path))
    keys = yaml.safe_load(path.read_text())
    assert 5 <= len(keys) <= 15, f"{path.name} has {len(keys)} keys"
    assert path.read_text().startswith("# "), f"{path.name} should open with a comment saying when to use it"
    assert config.mixed_precision == "bf16"
    if path.stem == "multi_node":
        assert config.num_machines == 2
    elif path.stem == "model_parallel":
        assert config.num_processes == 1
    else:
        assert config.num_processes == 4  # the reference setup: 4 GPUs on one machine
    if path.stem.startswith("fsdp") or path.stem == "multi_node":
        assert config.fsdp_config["fsdp_version"] == 2
    if path.stem.startswith("zero"):
        assert config.deepspeed_config["zero_stage"] == int(path.stem[4])
        # Accumulation and clipping come from the recipe flags on every strategy.
        assert "gradient_accumulation_steps" not in config.deepspeed_config
        assert "gradient_clipping" not in config.deepspeed_config


def test_hybrid_shard_config_asks_for_a_two_by_two_mesh():
    parallelism = load_config_from_file(str(CONFIGS / "fsdp_hybrid.yaml")).parallelism_config
    assert parallelism["parallelism_config_dp_replicate_size"] * parallelism["parallelism_config_dp_shard_size"] == 4


@pytest.mark.parametrize("name, mesh", [("tp", (1, 4)), ("fsdp_tp", (2, 2))])
def test_tensor_parallel_configs_split_the_four_gpus(name, mesh):
    """tp.yaml: one 4-way tensor parallel group; fsdp_tp.yaml: 2 FSDP shards x 2-way tensor parallel."""
    config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
    parallelism = config.parallelism_config
    sizes = (parallelism.get("parallelism_config_dp_shard_size", 1), parallelism["parallelism_config_tp_size"])
    assert sizes == mesh and sizes[0] * sizes[1] == config.num_processes
    assert config.distributed_type == ("FSDP" if name == "fsdp_tp" else "MULTI_GPU")


def model_parallel_device_map(config, gpu_memory: dict) -> dict:
    """The layer -> GPU plan that model_parallel.yaml's `device_map="auto"` makes for `config`
    (accelerate's `infer_auto_device_map`), computed on the meta device without any GPU."""
    import torch
    from accelerate import infer_auto_device_map, init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return infer_auto_device_map(model, max_memory=gpu_memory, no_split_module_classes=model._no_split_modules,
                                 dtype=torch.bfloat16)


@pytest.mark.parametrize("model", ["tinyllama-1.1b", "codellama-34b"])
def test_model_parallel_plan_spreads_layers_over_all_gpus(model):
    import json

    from transformers import AutoConfig

    config = AutoConfig.for_model(**json.loads((REPO / "data" / "model_configs" / f"{model}.json").read_text()))
    weights_gib = {"tinyllama-1.1b": 2.2, "codellama-34b": 68}[model]
    budget = f"{weights_gib / 4 * 1.25:.1f}GiB"  # each GPU takes a bit more than a quarter
    plan = model_parallel_device_map(config, {gpu: budget for gpu in range(4)})
    layer_devices = {device for name, device in plan.items() if ".layers." in name}
    assert layer_devices == {0, 1, 2, 3}, plan
    assert "disk" not in plan.values() and "cpu" not in plan.values()


def test_hybrid_shard_refuses_on_cpu_in_one_line(capsys):
    """Checked the way `accelerate launch` reads the file (scripts/check_config.py, in-process): torch's
    device mesh refuses CPU process groups, so on CPU the file stops in one line naming fsdp.yaml."""
    sys.path.insert(0, str(REPO / "scripts"))
    sys.path.insert(0, str(REPO / "recipes"))
    import check_config
    from common.launching.preflight import Refusal

    with pytest.raises(Refusal):
        check_config.check(CONFIGS / "fsdp_hybrid.yaml", "lora", num_processes=4, on_gpu=False)
    refusals = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(refusals) == 1 and refusals[0].startswith("error: hybrid sharding needs GPUs"), refusals
    assert "fsdp.yaml" in refusals[0]
    verdict = check_config.check(CONFIGS / "fsdp_hybrid.yaml", "lora", num_processes=4, on_gpu=True)[-1]
    assert verdict.startswith("ok: lora runs as fsdp_hybrid"), verdict
