"""A user's own config, as `accelerate config` writes it (every default key included), runs
the recipes unchanged."""

from __future__ import annotations

import pytest
import yaml

from conftest import launch

WRITTEN_BY_ACCELERATE_CONFIG = {
    "compute_environment": "LOCAL_MACHINE",
    "debug": False,
    "downcast_bf16": "no",
    "enable_cpu_affinity": False,
    "gpu_ids": "all",
    "machine_rank": 0,
    "main_training_function": "main",
    "mixed_precision": "no",
    "num_machines": 1,
    "num_processes": 2,
    "rdzv_backend": "static",
    "same_network": True,
    "tpu_env": [],
    "tpu_use_cluster": False,
    "tpu_use_sudo": False,
    "use_cpu": False,
}
STRATEGIES = {
    "ddp": ({"distributed_type": "MULTI_GPU"}, "MULTI_CPU"),
    "fsdp": ({
        "distributed_type": "FSDP",
        "fsdp_config": {
            "fsdp_activation_checkpointing": False,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_offload_params": False,
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
            "fsdp_version": 2,
        },
    }, "FSDP"),
    "deepspeed": ({
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {
            "gradient_accumulation_steps": 1,
            "offload_optimizer_device": "none",
            "offload_param_device": "none",
            "zero3_init_flag": False,
            "zero_stage": 2,
        },
    }, "DEEPSPEED"),
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_recipe_runs_under_a_config_written_by_accelerate_config(strategy, tmp_path):
    keys, distributed_type = STRATEGIES[strategy]
    config = tmp_path / "default_config.yaml"
    config.write_text(yaml.safe_dump({**WRITTEN_BY_ACCELERATE_CONFIG, **keys}))
    run = launch("lora", tmp_path / "out", "--max-steps", "3", "--batch-size", "4", config=str(config))
    assert run.returncode == 0, run.output[-3000:]
    ran = run.run_json()
    assert (ran["distributed_type"], ran["num_processes"]) == (distributed_type, 2)
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()
