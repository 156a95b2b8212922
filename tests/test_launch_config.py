"""The translations and refusals of recipes/common/launching/launch_config.py, one case at a time (in-process).

Each case starts from the environment `accelerate launch` would hand a recipe and checks what the
recipe makes of it; the real launches of users' files are in test_user_configs.py.
"""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
from common.launching import deepspeed_config, launch_config  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402

FSDP2_DEFAULTS = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
                  "FSDP_RESHARD_AFTER_FORWARD": "true", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}


def fsdp_env(**changes) -> dict:
    return {**FSDP2_DEFAULTS, **changes}


def adapt(env: dict, *argv: str, on_gpu: bool = False, recipe: str = "lora"):
    args = parse_args(recipe_flags(recipe), list(argv))
    run, notes = launch_config.adapt_launch(args, env=env, config_file=None, on_gpu=on_gpu)
    return notes, run


# FSDP: every file runs as FSDP2 with the sharding it asks for

@pytest.mark.parametrize("changes, reshard", [
    ({"FSDP_VERSION": "1"}, "true"),
    ({"FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"}, "false"),
    ({"FSDP_VERSION": "1", "FSDP_SHARDING_STRATEGY": "2"}, "false"),  # torch's number for SHARD_GRAD_OP
    ({"FSDP_VERSION": "1", "FSDP_RESHARD_AFTER_FORWARD": "full_shard"}, "true"),  # TRL's fsdp1.yaml style
    ({"FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "SHARD_GRAD_OP"}, "false"),  # "invalid truth value" before
    ({"FSDP_VERSION": "1", "FSDP_RESHARD_AFTER_FORWARD": "false"}, "false"),
])
def test_fsdp1_sharding_runs_as_fsdp2(changes, reshard):
    env = fsdp_env(**changes)
    notes, _ = adapt(env)
    assert (env["FSDP_VERSION"], env["FSDP_RESHARD_AFTER_FORWARD"]) == ("2", reshard)
    assert notes[0].endswith(f"-> FSDP2 with reshard_after_forward {reshard}")


def test_an_fsdp2_file_is_left_as_it_is():
    env = fsdp_env(FSDP_STATE_DICT_TYPE="FULL_STATE_DICT")
    before = dict(env)
    assert adapt(env)[0] == [] and env == before


def test_fsdp1_only_settings_are_named_in_the_translation():
    env = fsdp_env(FSDP_VERSION="1", FSDP_BACKWARD_PREFETCH="BACKWARD_PRE", FSDP_STATE_DICT_TYPE="LOCAL_STATE_DICT")
    notes, _ = adapt(env)
    assert "FSDP_BACKWARD_PREFETCH" not in env  # FSDP2 has no such knob; accelerate would warn about it
    assert env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"
    assert notes[1:] == ["LOCAL_STATE_DICT -> SHARDED_STATE_DICT", "prefetch: FSDP2 prefetches the next layer itself",
                         "use_orig_params / sync_module_states: not needed by FSDP2"]


def test_no_shard_runs_as_ddp_and_refuses_offload():
    env = fsdp_env(FSDP_VERSION="1", FSDP_SHARDING_STRATEGY="NO_SHARD")
    assert adapt(env)[0] == ["NO_SHARD -> DDP"] and env["ACCELERATE_USE_FSDP"] == "false"
    with pytest.raises(Refusal, match="fsdp_offload_params needs sharding, but the sharding strategy is NO_SHARD"):
        adapt(fsdp_env(FSDP_SHARDING_STRATEGY="NO_SHARD", FSDP_OFFLOAD_PARAMS="true"))


def test_activation_checkpointing_is_kept_under_no_shard_and_its_offload_is_named():
    env = fsdp_env(FSDP_SHARDING_STRATEGY="NO_SHARD", FSDP_ACTIVATION_CHECKPOINTING="true")
    notes, args = adapt(env)
    assert args.gradient_checkpointing == 1 and notes[0] == "NO_SHARD -> DDP"
    assert notes[1].startswith("fsdp_activation_checkpointing -> --gradient-checkpointing")
    env = fsdp_env(FSDP_ACTIVATION_CHECKPOINTING="true", FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD="true")
    notes, args = adapt(env)
    assert args.gradient_checkpointing == 1 and env["FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"] == "false"
    assert "fsdp_activation_checkpointing_offload: not done" in notes[-1]
    with pytest.raises(Refusal, match="fsdp_activation_checkpointing_offload needs fsdp_activation_checkpointing"):
        adapt(fsdp_env(FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD="true"))


def test_hybrid_shard_needs_gpus_and_becomes_a_two_level_mesh_on_them():
    with pytest.raises(Refusal, match="hybrid sharding needs GPUs"):
        adapt(fsdp_env(FSDP_VERSION="1", FSDP_SHARDING_STRATEGY="HYBRID_SHARD"))
    env = fsdp_env(FSDP_VERSION="1", FSDP_SHARDING_STRATEGY="_HYBRID_SHARD_ZERO2", WORLD_SIZE="8", LOCAL_WORLD_SIZE="4")
    notes, _ = adapt(env, on_gpu=True)
    assert (env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("2", "4")
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == "false"
    assert "hybrid: replicated over 2 machines, sharded over 4" in notes
    one_machine = fsdp_env(FSDP_SHARDING_STRATEGY="HYBRID_SHARD")
    assert "hybrid shard on one machine = full shard over its processes" in adapt(one_machine, on_gpu=True)[0]
    assert "PARALLELISM_CONFIG_DP_REPLICATE_SIZE" not in one_machine


@pytest.mark.parametrize("changes, message", [
    ({"FSDP_STATE_DICT_TYPE": "FULL"}, "fsdp_state_dict_type `FULL` is not one of FULL_STATE_DICT, SHARDED_STATE_DICT"),
    ({"FSDP_SHARDING_STRATEGY": "FULL-SHARD"}, "fsdp_sharding_strategy `FULL-SHARD` is not one of FULL_SHARD"),
    ({"FSDP_RESHARD_AFTER_FORWARD": "maybe"}, "fsdp_reshard_after_forward `maybe` is neither true / false nor one of"),
    ({"FSDP_OFFLOAD_PARAMS": "sometimes"}, "fsdp_offload_params `sometimes` is not true or false"),
    ({"FSDP_VERSION": "3"}, "fsdp_version `3` is not 1 or 2"),
])
def test_a_value_accelerate_would_choke_on_is_refused(changes, message):
    with pytest.raises(Refusal, match=message):
        adapt(fsdp_env(**changes))


@pytest.mark.parametrize("size, message", [
    ("PARALLELISM_CONFIG_CP_SIZE", "context parallel (parallelism_config_cp_size: 2) is not supported"),
    ("PARALLELISM_CONFIG_SP_SIZE", "sequence parallel (parallelism_config_sp_size: 2) runs under DeepSpeed"),
])
def test_sequence_sharding_is_refused_on_every_machine(size, message):
    for on_gpu in (False, True):
        with pytest.raises(Refusal, match=message.replace("(", r"\(").replace(")", r"\)")):
            adapt(fsdp_env(ACCELERATE_USE_PARALLELISM_CONFIG="true", **{size: "2"}), on_gpu=on_gpu)


# Tensor parallel: transformers splits the layers at load, accelerate runs the loop

def tp_env(tp: int, shard: int = 1, processes: int = 4, fsdp: bool = False, **changes) -> dict:
    """What the launcher hands a recipe for tp.yaml (MULTI_GPU) or fsdp_tp.yaml (FSDP) with these sizes."""
    base = fsdp_env(WORLD_SIZE=str(processes)) if fsdp else {"WORLD_SIZE": str(processes)}
    return {**base, "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": str(tp),
            "PARALLELISM_CONFIG_DP_SHARD_SIZE": str(shard), "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "1", **changes}


def test_tensor_parallel_alone_runs_as_the_file_says():
    env = tp_env(4)
    assert adapt(env)[0] == ["tensor parallel: each layer split over 4 processes, which share each batch"]


def test_fsdp_by_tensor_parallel_is_handed_to_transformers():
    env = tp_env(2, shard=2, fsdp=True)
    notes, _ = adapt(env, on_gpu=True)
    assert notes[-1] == "FSDP x TP: transformers shards the model as it loads: 2 FSDP shards x 2-way tensor parallel"
    assert env["ACCELERATE_USE_FSDP"] == "false"  # accelerate must not wrap the model again


@pytest.mark.parametrize("env, message", [
    (tp_env(2), "tp_size 2 x dp_shard_size 1 = 2 processes, but 4 were launched; launch 2 (--num_processes 2)"),
    (tp_env(2, shard=2), "dp_shard_size 2 shards with FSDP, but distributed_type is not FSDP; set `distributed_type: FSDP`"),
    (tp_env(4, fsdp=True), "FSDP with tp_size 4 = all 4 processes leaves FSDP nothing to shard; use accelerate_configs/tp.yaml"),
    (tp_env(2, shard=2, fsdp=True, FSDP_OFFLOAD_PARAMS="true"), "fsdp_offload_params is not available with tensor parallel"),
    (tp_env(2, shard=2, fsdp=True, FSDP_ACTIVATION_CHECKPOINTING="true"), "pass --gradient-checkpointing to the recipe instead"),
    (tp_env(2, shard=2, fsdp=True, FSDP_RESHARD_AFTER_FORWARD="false"), "set fsdp_reshard_after_forward: true"),
    (tp_env(2, shard=1, PARALLELISM_CONFIG_DP_REPLICATE_SIZE="2"), "dp_replicate_size 2 with tensor parallel is not supported"),
    (tp_env(2, ACCELERATE_USE_DEEPSPEED="true"), "with DeepSpeed is not supported by these recipes"),
])
def test_a_tensor_parallel_mesh_that_cannot_run_is_refused(env, message):
    with pytest.raises(Refusal, match=message.replace("(", r"\(").replace(")", r"\)").replace("`", ".")):
        adapt(env, on_gpu=True)


def test_fsdp_by_tensor_parallel_needs_a_transformers_that_shards_both_ways(monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "5.17.0" if name == "transformers" else real(name))
    with pytest.raises(Refusal, match=r"FSDP x TP needs transformers >= 5.18.0 \(this is 5.17.0\)"):
        adapt(tp_env(2, shard=2, fsdp=True), on_gpu=True)


# DeepSpeed: the JSON and the recipe's flags agree


def deepspeed_env(tmp_path, config: dict, **changes) -> dict:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, **config}))
    return {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path), "WORLD_SIZE": "2",
            "ACCELERATE_MIXED_PRECISION": "no", **changes}


def test_values_the_file_fixes_become_the_flags_unless_typed(tmp_path):
    env = deepspeed_env(tmp_path, {"gradient_accumulation_steps": 4, "gradient_clipping": 0.5,
                                   "train_micro_batch_size_per_gpu": 2, "train_batch_size": 16})
    notes, args = adapt(env)
    assert (args.grad_accum, args.max_grad_norm, args.batch_size) == (4, 0.5, 2)
    assert notes == ["--grad-accum 4 (its gradient_accumulation_steps)", "--max-grad-norm 0.5 (its gradient_clipping)",
                     "--batch-size 2 (its train_micro_batch_size_per_gpu)",
                     "--global-batch-size 16 (its train_batch_size)"]
    with pytest.raises(Refusal, match="sets gradient_accumulation_steps = 4 but --grad-accum is 2; pass the same value"):
        adapt(env, "--grad-accum=2")
    assert adapt(env, "--grad-accum", "4")[1].grad_accum == 4  # typed and equal: fine


def test_a_train_batch_size_becomes_the_global_batch_unless_typed(tmp_path):
    notes, args = adapt(deepspeed_env(tmp_path, {"train_batch_size": 64}))
    assert args.global_batch_size == 64 and "--global-batch-size 64 (its train_batch_size)" in notes
    with pytest.raises(Refusal, match=r"train_batch_size = 64 but --global-batch-size is 32"):
        adapt(deepspeed_env(tmp_path, {"train_batch_size": 64}), "--global-batch-size", "32")


def test_an_adamw_section_becomes_the_recipes_adamw_and_others_are_refused(tmp_path):
    adamw = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.1, "torch_adam": True, "adam_w_mode": True}}
    notes, args = adapt(deepspeed_env(tmp_path, {"optimizer": adamw}))
    assert args.weight_decay == 0.1 and "optimizer AdamW -> the recipe's AdamW" in notes
    for section, message in [({"type": "Lamb"}, "asks for a DeepSpeed Lamb optimizer"),
                             ({"type": "Adam", "params": {"adam_w_mode": False}}, "asks for a DeepSpeed Adam optimizer"),
                             ({"type": "AdamW", "params": {"betas": [0.9, 0.95]}}, "AdamW with betas optimizer")]:
        with pytest.raises(Refusal, match=message):
            adapt(deepspeed_env(tmp_path, {"optimizer": section}))


# DeepSpeed scheduler sections: run as the file asks, "auto" from the recipe's flags

AUTO_WARMUP = {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}


def test_a_scheduler_section_runs_as_written_with_auto_from_the_recipe(tmp_path):
    notes, args = adapt(deepspeed_env(tmp_path, {"scheduler": {"type": "WarmupLR", "params": AUTO_WARMUP}}), "--lr", "2e-4")
    assert args.deepspeed_scheduler == {"type": "WarmupLR", "params": AUTO_WARMUP} and args.lr == 2e-4
    assert ("scheduler WarmupLR runs as the file asks (from the recipe: warmup_min_lr 0, warmup_max_lr --lr, "
            "warmup_num_steps --warmup-ratio x the run's steps)") in notes
    fixed = {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 3e-5, "warmup_num_steps": 10, "warmup_type": "linear"}}
    notes, args = adapt(deepspeed_env(tmp_path, {"scheduler": fixed}))
    assert args.lr == 3e-5 and "lr" in args.given_flags  # the file's peak rate is the run's --lr
    assert any(note.startswith("scheduler WarmupDecayLR runs as the file asks (warmup_max_lr 3e-05, warmup_num_steps 10, "
                               "warmup_type linear; from the recipe: warmup_min_lr 0, total_num_steps") for note in notes)


@pytest.mark.parametrize("section, argv, message", [
    ({"type": "OneCycle"}, (), "asks for a DeepSpeed OneCycle scheduler; the recipes run WarmupLR, WarmupDecayLR, WarmupCosineLR"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}, ("--lr", "2e-4"),
     r"sets warmup_max_lr = 0.001 but --lr is 0.0002; pass the same value"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 100}}, ("--warmup-ratio", "0.1"),
     "sets warmup_num_steps = 100 and --warmup-ratio is given too"),
    ({"type": "WarmupLR", "params": {"warmup_num_step": 100}}, (), "did you mean `warmup_num_steps`"),
    ({"type": "WarmupCosineLR", "params": {"warmup_max_lr": "auto"}}, (), "`warmup_max_lr` in the WarmupCosineLR scheduler"),
    ({"type": "WarmupCosineLR", "params": {"cos_min_ratio": "auto"}}, (), "the recipe has no setting for it"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cubic"}}, (), "give \"log\" or \"linear\""),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 0}}, (), "give a whole number >= 1"),
])
def test_a_scheduler_section_the_recipe_cannot_run_is_refused_in_one_line(tmp_path, section, argv, message):
    with pytest.raises(Refusal, match=message):
        adapt(deepspeed_env(tmp_path, {"scheduler": section}), *argv)


def learning_rates(section: dict, lr: float, warmup_ratio: float, total_steps: int) -> list[float]:
    """The rate each optimizer step of the recipe runs at, under `deepspeed_schedule`."""
    import torch

    args = parse_args(recipe_flags("lora"), ["--lr", str(lr), "--warmup-ratio", str(warmup_ratio)])
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = deepspeed_config.deepspeed_schedule(optimizer, section, args, total_steps)
    rates = []
    for _ in range(total_steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_each_schedule_is_deepspeeds_arithmetic_step_by_step():
    """DeepSpeed's formulas, written out: its first step runs at its warm-up's start (iteration 0)."""
    import math

    lr, steps = 1e-3, 40  # warm-up: 0.25 x 40 = 10 steps when "auto"
    iteration = [max(0, step - 1) for step in range(steps)]
    log_warmup = [min(1.0, math.log(i + 1) / math.log(10)) if i < 10 else 1.0 for i in iteration]
    assert learning_rates({"type": "WarmupLR", "params": dict(AUTO_WARMUP)}, lr, 0.25, steps) == pytest.approx(
        [lr * gamma for gamma in log_warmup])
    decay = {"type": "WarmupDecayLR", "params": {**AUTO_WARMUP, "warmup_min_lr": 1e-5, "warmup_type": "linear",
                                                 "total_num_steps": "auto"}}
    linear = [i / 10 if i < 10 else max(0.0, (steps - i) / (steps - 10)) for i in iteration]
    assert learning_rates(decay, lr, 0.25, steps) == pytest.approx([1e-5 + (lr - 1e-5) * gamma for gamma in linear])
    cosine = {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5, "warmup_type": "linear", "cos_min_ratio": 0.1,
                                                   "warmup_min_ratio": 0.2}}
    ratios = [0.2 + 0.8 * i / 5 if i < 5 else 0.1 + 0.9 * (1 + math.cos(math.pi * min(1, (i - 4) / (steps - 5)))) / 2
              for i in iteration]
    ratios[0] = 0.0  # before its first iteration DeepSpeed's cosine schedule runs at 0
    assert learning_rates(cosine, lr, 0.25, steps) == pytest.approx([lr * ratio for ratio in ratios], rel=1e-6)


def test_deepspeed_autotp_is_refused_naming_the_tensor_parallel_config(tmp_path):
    with pytest.raises(Refusal, match="asks for DeepSpeed AutoTP .* launch with accelerate_configs/tp.yaml"):
        adapt(deepspeed_env(tmp_path, {"tensor_parallel": {"autotp_size": 2}}))
    assert adapt(deepspeed_env(tmp_path, {"tensor_parallel": {"autotp_size": 1}}))[0] == []


def test_the_files_precision_is_what_runs(tmp_path):
    env = deepspeed_env(tmp_path, {"bf16": {"enabled": True}})
    assert "precision bf16 (its bf16.enabled)" in adapt(env)[0]
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"  # the plan and the model's dtypes follow it
    auto = deepspeed_env(tmp_path, {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}})
    assert adapt(auto)[0] == [] and auto["ACCELERATE_MIXED_PRECISION"] == "no"
    for config, changes, message in [
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, {}, "enables both bf16 and fp16"),
        ({"bf16": {"enabled": True}}, {"ACCELERATE_MIXED_PRECISION": "fp16"}, "enables bf16 but the launch asks for"),
        ({"fp16": {"enabled": True}}, {}, "trains in fp16, which DeepSpeed cannot do on CPU"),
    ]:
        with pytest.raises(Refusal, match=message):
            adapt(deepspeed_env(tmp_path, config, **changes))
    assert adapt(deepspeed_env(tmp_path, {"fp16": {"enabled": True}}), on_gpu=True)[0] == ["precision fp16 (its fp16.enabled)"]


def test_a_precision_given_as_a_bare_switch_names_the_block_form(tmp_path):
    with pytest.raises(Refusal, match=r'"fp16" in .* is true; DeepSpeed reads a block: write "fp16": \{"enabled": true\}'):
        adapt(deepspeed_env(tmp_path, {"fp16": True}))


def test_a_value_the_file_sets_is_refused_under_the_files_key(tmp_path):
    from common.launching.quick_checks import check_ranges

    _, args = adapt(deepspeed_env(tmp_path, {"gradient_clipping": 0.0}))
    with pytest.raises(Refusal, match=r"--max-grad-norm \(set by gradient_clipping in .*ds.json\) must be > 0"):
        check_ranges(args)


def test_deepspeeds_batch_rule_and_checkpointing_section_become_the_flags(tmp_path):
    notes, args = adapt(deepspeed_env(tmp_path, {"train_batch_size": 16, "gradient_accumulation_steps": 4}))
    assert (args.batch_size, args.grad_accum, args.global_batch_size) == (2, 4, 16)  # 16 / (4 x 2 processes)
    assert "--batch-size 2 (its train_batch_size / gradient_accumulation_steps / 2 processes)" in notes
    notes, args = adapt(deepspeed_env(tmp_path, {"activation_checkpointing": {"partition_activations": True}}))
    assert args.gradient_checkpointing == 1 and notes[-1].startswith("activation_checkpointing -> --gradient-")
    assert adapt(deepspeed_env(tmp_path, {"activation_checkpointing": {"partition_activations": False}}))[1] \
        .gradient_checkpointing == 0
    with pytest.raises(Refusal, match="the launch asks for --mixed_precision fp16, which DeepSpeed cannot do on CPU"):
        adapt(deepspeed_env(tmp_path, {}, ACCELERATE_MIXED_PRECISION="fp16"))


def test_turning_on_the_gathered_save_is_said(tmp_path):
    zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}
    notes, _ = adapt(deepspeed_env(tmp_path, {"zero_optimization": zero}))
    assert notes == ["stage3_gather_16bit_weights_on_model_save -> true (the final save gathers the full weights)"]


def test_a_zero_section_without_a_stage_gets_deepspeeds_default():
    args = parse_args(recipe_flags("lora"), [])
    config = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    deepspeed_config.edit_deepspeed(config, args)
    assert config["zero_optimization"]["stage"] == 0  # accelerate reads it when the model is saved


def test_a_torch_compile_section_turns_on_compile(tmp_path):
    """axolotl's zero1_torch_compile.json: DeepSpeed itself refuses this form of `compile`."""
    notes, args = adapt(deepspeed_env(tmp_path, {"compile": {"disable": False, "backend": "inductor"}}))
    assert args.compile and notes == ["--compile (its compile section)"]
    assert not adapt(deepspeed_env(tmp_path, {"compile": {"disable": True}}))[1].compile
    with pytest.raises(Refusal, match="asks torch.compile for the `eager` backend"):
        adapt(deepspeed_env(tmp_path, {"compile": {"backend": "eager"}}))
    engine_config = {"zero_optimization": {"stage": 1}, "compile": {"disable": False, "backend": "inductor"}}
    deepspeed_config.edit_deepspeed(engine_config, args)
    assert "compile" not in engine_config


def test_a_typo_in_zero_optimization_names_the_setting(tmp_path):
    zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_sav": True}
    with pytest.raises(Refusal, match="`stage3_gather_16bit_weights_on_model_sav` in zero_optimization of .* is not a "
                                      "DeepSpeed setting; did you mean `stage3_gather_16bit_weights_on_model_save`"):
        adapt(deepspeed_env(tmp_path, {"zero_optimization": zero}))


def test_a_zero_setting_under_both_its_names_is_named(tmp_path):
    zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True, "gather_16bit_weights_on_model_save": True}
    with pytest.raises(Refusal, match="gives `gather_16bit_weights_on_model_save` twice, under its two names"):
        adapt(deepspeed_env(tmp_path, {"zero_optimization": zero}))


def test_the_engine_config_keeps_the_files_names_and_the_recipes_loop():
    args = parse_args(recipe_flags("lora"), ["--grad-accum", "2"])
    axolotl = {"zero_optimization": {"stage": 3, "gather_16bit_weights_on_model_save": False},
               "optimizer": {"type": "AdamW"}, "gradient_accumulation_steps": 1}
    deepspeed_config.edit_deepspeed(axolotl, args)
    # DeepSpeed refuses a config that holds both names of the same setting
    assert axolotl["zero_optimization"] == {"stage": 3, "gather_16bit_weights_on_model_save": True}
    assert (axolotl["gradient_accumulation_steps"], axolotl["gradient_clipping"]) == (2, 1.0)
    assert "optimizer" not in axolotl
    plain = {"zero_optimization": {"stage": 3}}
    deepspeed_config.edit_deepspeed(plain, args)
    assert plain["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


# The file the launcher read


def test_the_launchers_config_file_is_found_in_its_command_line(tmp_path):
    launcher = ["/usr/bin/python", "/usr/bin/accelerate", "launch"]
    assert launch_config.config_file_of_launcher(launcher + ["--config_file", "a.yaml", "x.py"]).name == "a.yaml"
    assert launch_config.config_file_of_launcher(launcher + ["--config-file=b.yaml", "x.py"]).name == "b.yaml"
    assert launch_config.config_file_of_launcher(["/usr/bin/python", "-m", "torch.distributed.run", "x.py"]) is None


@pytest.mark.parametrize("config, problem", [
    ({"fsdp_config": {"version": 2, "fsdp_offload_params": True}}, None),  # accelerate adds the fsdp_ prefix
    ({"fsdp_config": {"fsdp_sharding_stratgy": "FULL_SHARD"}}, "did you mean `fsdp_sharding_strategy`?"),
    ({"parallelism_config": {"dp_shard_size": 2}}, "did you mean `parallelism_config_dp_shard_size`?"),
    ({"deepspeed_config": {"zero_stag": 3}}, "did you mean `zero_stage`?"),
    ({"distributed_typ": "FSDP"}, "`distributed_typ` at the top level is not an accelerate setting"),
])
def test_keys_accelerate_does_not_read_are_named(config, problem):
    found = launch_config.unknown_key({"distributed_type": "FSDP", **config})
    assert found == problem if problem is None else problem in found


def test_the_recipe_knows_which_flags_were_typed():
    args = parse_args(recipe_flags("qlora"), ["--lr", "1e-4", "--grad-accum=2", "--bits", "4"])
    assert args.given_flags == ["bits", "grad_accum", "lr"]


def test_the_files_num_processes_counts_as_asked_for(tmp_path, monkeypatch):
    path = tmp_path / "multi_cpu.yaml"
    path.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n")
    launcher = ["/usr/bin/python", "/usr/bin/accelerate", "launch", "--config_file", str(path), "recipes/lora.py"]
    monkeypatch.setattr(launch_config, "launcher_argv", lambda: launcher)
    assert launch_config.requested_processes_of_launcher() == 2
    with pytest.raises(Refusal, match="distributed_type MULTI_CPU starts one process unless mpirun is set up, but 2"):
        launch_config.refuse_one_process_for_several("MULTI_CPU", launch_config.requested_processes_of_launcher())
    monkeypatch.setattr(launch_config, "launcher_argv", lambda: [*launcher[:3], "--num_processes", "3", *launcher[3:]])
    assert launch_config.requested_processes_of_launcher() == 3  # the command line wins, as in accelerate


def test_the_dynamo_settings_compile_does_not_apply_are_named():
    env = {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_DYNAMO_MODE": "max-autotune",
           "ACCELERATE_DYNAMO_USE_FULLGRAPH": "True", "ACCELERATE_DYNAMO_USE_DYNAMIC": "False"}
    notes, args = adapt(env)
    assert args.compile and notes == ["dynamo_backend INDUCTOR -> --compile (each decoder layer compiled in place); "
                                      "not applied: dynamo_mode max-autotune, dynamo_use_fullgraph True"]
