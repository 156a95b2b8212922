"""Config files no project ships but users write: variants of the keys `accelerate config` and
DeepSpeed accept. Each runs as it asks (saying what was translated) or is refused in one line
that names the key and the fix; none may end in a traceback, before or after the model loads."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from conftest import REPO, assert_no_traceback_of_ours, launch, long_test

sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "recipes"))
import check_config  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402

FSDP1 = {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}}
FSDP2 = {"distributed_type": "FSDP", "num_processes": 2, "fsdp_config": {"fsdp_version": 2}}


def fsdp(base: dict, **keys) -> dict:
    return {**base, "fsdp_config": {**base["fsdp_config"], **keys}}


def zero(stage=2, **keys) -> dict:
    return {"zero_optimization": {"stage": stage}, **keys}


# name -> (file contents: a dict written as YAML, a dict with "zero_optimization" written as a DeepSpeed
# JSON, or raw text), and on this CPU machine: "ok" plus the notes the config line must hold, or the
# start / a piece of the one-line refusal.
CASES = {
    # translated and run
    "fsdp1_size_based_wrap": (fsdp(FSDP1, fsdp_auto_wrap_policy="SIZE_BASED_WRAP", fsdp_min_num_params=100000),
                              ("ok", "SIZE_BASED_WRAP -> TRANSFORMER_BASED_WRAP")),
    "fsdp2_local_state_dict": (fsdp(FSDP2, fsdp_state_dict_type="LOCAL_STATE_DICT"),
                               ("ok", "LOCAL_STATE_DICT -> SHARDED_STATE_DICT")),
    "fsdp2_activation_checkpointing": (fsdp(FSDP2, fsdp_activation_checkpointing=True),
                                       ("ok", "fsdp_activation_checkpointing -> --gradient-checkpointing")),
    "fsdp2_backward_prefetch": (fsdp(FSDP2, fsdp_backward_prefetch="BACKWARD_PRE"),
                                ("ok", "prefetch: FSDP2 prefetches the next layer itself")),
    "dynamo_inductor": ({"distributed_type": "MULTI_GPU", "num_processes": 2,
                         "dynamo_config": {"dynamo_backend": "INDUCTOR"}}, ("ok", "dynamo_backend INDUCTOR -> --compile")),
    "deepspeed_legacy_bfloat16": (zero(bfloat16={"enabled": True}), ("ok", "precision bf16")),
    "deepspeed_no_batch_keys": (zero(3), ("ok",)),
    "deepspeed_stage_as_text": (zero("3"), ("ok",)),
    "deepspeed_scheduler_null": (zero(scheduler=None), ("ok",)),
    "deepspeed_other_top_level_keys": (zero(steps_per_print=10, wall_clock_breakdown=False, prescale_gradients=False,
                                            zero_allow_untested_optimizer=True, communication_data_type="fp32"), ("ok",)),
    # DeepSpeed's deprecated names and its stage3_* aliases (docs/config-files.md): read as their settings
    "deepspeed_old_gather_name": ({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}},
                                  ("ok", "stage3_gather_fp16_weights_on_model_save -> gather_16bit_weights_on_model_save")),
    "deepspeed_cpu_offload": ({"zero_optimization": {"stage": 2, "cpu_offload": True}},
                              ("ok", "cpu_offload -> offload_optimizer")),
    "deepspeed_cpu_offload_false": ({"zero_optimization": {"stage": 2, "cpu_offload": False}},
                                    ("ok", "cpu_offload (false) dropped")),
    "deepspeed_cpu_offload_param": ({"zero_optimization": {"stage": 3, "cpu_offload_param": True}},
                                    ("ok", "cpu_offload_param -> offload_param", "zero3_offload")),
    "deepspeed_cpu_offload_pin_memory": ({"zero_optimization": {"stage": 3, "cpu_offload": True,
                                                                "cpu_offload_use_pin_memory": True}},
                                         ("ok", "cpu_offload_use_pin_memory -> pin_memory in offload_optimizer")),
    "deepspeed_boolean_zero": ({"zero_optimization": True, "allgather_size": 100000000},
                               ("ok", '"zero_optimization": true -> {"stage": 1, "allgather_bucket_size": 100000000}')),
    "deepspeed_stage3_aliases": ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1000000,
                                                        "stage3_param_persistence_threshold": 10000,
                                                        "stage3_max_live_parameters": 100000000,
                                                        "stage3_max_reuse_distance": 100000000,
                                                        "stage3_gather_16bit_weights_on_model_save": False}},
                                 ("ok", "stage3_gather_16bit_weights_on_model_save -> true")),
    # refused in one line
    "deepspeed_old_and_new_names_disagree": ({"zero_optimization": {"stage": 2, "cpu_offload": True,
                                                                    "offload_optimizer": {"device": "none"}}},
                                             "keep `offload_optimizer` and delete `cpu_offload`"),
    "deepspeed_removed_amp_section": (zero(amp={"enabled": False}), "error: DeepSpeed refuses the config it would start with"),
    "deepspeed_cpu_offload_param_at_stage_2": ({"zero_optimization": {"stage": 2, "cpu_offload_param": True}},
                                               "offload_param in"),
    "deepspeed_stage_auto": (zero("auto"), "error: zero_optimization.stage in"),
    "deepspeed_top_level_list": ("[{\"zero_optimization\": {\"stage\": 2}}]", "holds no settings"),
    "deepspeed_fractional_micro_batch": (zero(train_micro_batch_size_per_gpu=2.5),
                                         "error: train_micro_batch_size_per_gpu in"),
    "deepspeed_zero_accumulation": (zero(gradient_accumulation_steps=0), "error: gradient_accumulation_steps in"),
    "deepspeed_apex_amp": (zero(amp={"enabled": True, "opt_level": "O1"}), "which DeepSpeed has removed"),
    "deepspeed_nvme_offload": ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}},
                               "offloads to NVMe"),
    "deepspeed_zero1_param_offload": ({"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}},
                                      "offload_param in"),
    "deepspeed_misspelt_top_level_key": (zero(gradient_acumulation_steps=4), "did you mean `gradient_accumulation_steps`?"),
    "deepspeed_zero_key_at_top_level": (zero(offload_optimizer={"device": "cpu"}), "move it into the \"zero_optimization\""),
    "deepspeed_batch_sizes_that_disagree": (zero(train_batch_size=16, train_micro_batch_size_per_gpu=2,
                                                 gradient_accumulation_steps=2), "= 8; fix one of the three"),
    "deepspeed_optimizer_without_type": (zero(optimizer={"params": {"lr": "auto"}}), "without a \"type\""),
    "megatron": ({"distributed_type": "MEGATRON_LM", "num_processes": 2}, "distributed_type MEGATRON_LM is not"),
    "xla": ({"distributed_type": "XLA", "num_processes": 2}, "distributed_type XLA is not"),
    "multi_cpu_two_processes": ({"distributed_type": "MULTI_CPU", "num_processes": 2, "mixed_precision": "no"},
                                "error: distributed_type MULTI_CPU starts one process"),
    "a_key_written_twice": ("distributed_type: MULTI_GPU\ndistributed_type: FSDP\nnum_processes: 2\n",
                            "`distributed_type` is set twice"),
    "deepspeed_key_written_twice": ('{"zero_optimization": {"stage": 2, "stage": 3}}', "`stage` is set twice"),
    "an_old_ipex_section": ({"distributed_type": "MULTI_GPU", "num_processes": 2, "ipex_config": {"ipex": False}},
                            "(accelerate launch stops at it); fix or delete it"),
    "unquoted_no": ("distributed_type: NO\nnum_processes: 1\n", "write it in quotes"),
    "empty_file": ("", "holds no settings"),
    "tabs": ("distributed_type: FSDP\nfsdp_config:\n\tfsdp_version: 2\n", "cannot be read"),
    "fp8_without_a_backend": ({"distributed_type": "MULTI_GPU", "num_processes": 2, "mixed_precision": "fp8"},
                              "error: accelerate cannot launch"),
}


def write(tmp_path, name: str, contents) -> str:
    if isinstance(contents, str):
        path = tmp_path / (name + (".json" if contents.startswith(("[", "{")) else ".yaml"))
        path.write_text(contents)
    elif "zero_optimization" in contents:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(contents))
    else:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(contents))
    return str(path)


@pytest.mark.parametrize("name", sorted(CASES))
def test_variant_runs_as_asked_or_is_refused_in_one_line(name, tmp_path, capsys):
    contents, expected = CASES[name]
    path = write(tmp_path, name, contents)
    try:
        lines = check_config.check(path, "lora", num_processes=2, on_gpu=False)
    except Refusal:
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, errors
        assert not isinstance(expected, tuple), f"refused, expected to run: {errors[0]}"
        assert errors[0].startswith(expected) or expected in errors[0], errors[0]
        return
    assert isinstance(expected, tuple), f"ran, expected a refusal ({expected}): {lines}"
    assert lines[-1].startswith("ok: lora runs as"), lines
    notes = " ".join(lines)  # the translations and the strategy it runs as
    assert all(note in notes for note in expected[1:]), lines


# Real launches of the translations that change what is built (the wrapping, the checkpointing, the
# DeepSpeed batch size and precision): they must train and save, not only pass the checks. (The FSDP1 one runs
# in the long tests: tests/test_user_configs.py launches an FSDP1 file on every run.)
LAUNCHED = {
    "fsdp1_wrap_checkpointing": (fsdp(FSDP1, fsdp_auto_wrap_policy="SIZE_BASED_WRAP", fsdp_min_num_params=100000,
                                      fsdp_activation_checkpointing=True, fsdp_state_dict_type="LOCAL_STATE_DICT"),
                                 {"distributed_type": "FSDP", "precision": "no", "gradient_checkpointing": 1}),
    "deepspeed_minimal_bfloat16": (zero(2, bfloat16={"enabled": True}),
                                   {"distributed_type": "DEEPSPEED", "precision": "bf16", "gradient_checkpointing": 0}),
}
# The other deprecated names and aliases, launched under RECIPES_LONG_TESTS (~12 s each; each translation is
# checked in-process above on every run)
LONG_LAUNCHED = {
    # the old export name beside the recipe's own addition of the new one (DeepSpeed refused both at prepare),
    # with the old offload and pinning names
    "deepspeed_zero3_old_names": ({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True,
                                                         "cpu_offload": True, "cpu_offload_use_pin_memory": True}},
                                  {"distributed_type": "DEEPSPEED", "precision": "no", "gradient_checkpointing": 0,
                                   "deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "none"}}),
    "deepspeed_zero2_cpu_offload": ({"zero_optimization": {"stage": 2, "cpu_offload": True}},
                                    {"distributed_type": "DEEPSPEED", "precision": "no", "gradient_checkpointing": 0,
                                     "deepspeed": {"zero_stage": 2, "offload_optimizer": "cpu"}}),
    "deepspeed_zero3_cpu_offload_param": ({"zero_optimization": {"stage": 3, "cpu_offload_param": True}},
                                          {"distributed_type": "DEEPSPEED", "precision": "no", "gradient_checkpointing": 0,
                                           "deepspeed": {"zero_stage": 3, "offload_param": "cpu"}}),
    "deepspeed_boolean_zero": ({"zero_optimization": True},
                               {"distributed_type": "DEEPSPEED", "precision": "no", "gradient_checkpointing": 0,
                                "deepspeed": {"zero_stage": 1}}),
    "deepspeed_zero3_aliases": (CASES["deepspeed_stage3_aliases"][0],
                                {"distributed_type": "DEEPSPEED", "precision": "no", "gradient_checkpointing": 0,
                                 "deepspeed": {"zero_stage": 3, "offload_param": "none"}}),
}


# (both long: test_user_configs.py launches an FSDP1 and a DeepSpeed file every run, test_mixed_precision.py bf16)
@pytest.mark.parametrize("name", [*(pytest.param(name, marks=long_test) for name in sorted(LAUNCHED)),
                                  *(pytest.param(name, marks=long_test) for name in sorted(LONG_LAUNCHED))])
def test_translated_variant_trains_and_saves(name, tmp_path):
    contents, expected = {**LAUNCHED, **LONG_LAUNCHED}[name]
    run = launch("lora", tmp_path / "out", "--max-steps", "2", "--batch-size", "2", "--eval-every", "0",
                 config=write(tmp_path, name, contents), mixed_precision=None)
    assert run.returncode == 0, run.output[-3000:]
    assert sum(line.startswith("config: ") for line in run.output.splitlines()) == 1, run.output[-3000:]
    ran = run.run_json()
    assert (ran["distributed_type"], ran["strategy"]["precision"]) == (expected["distributed_type"], expected["precision"])
    assert ran["arguments"]["gradient_checkpointing"] == expected["gradient_checkpointing"]
    engine = ran["strategy"].get("deepspeed", {})
    assert {key: engine.get(key) for key in expected.get("deepspeed", {})} == expected.get("deepspeed", {}), engine
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()


@long_test  # torch.compile of each layer on CPU: ~2 minutes
def test_a_dynamo_config_compiles_the_layers_and_saves(tmp_path):
    config = write(tmp_path, "dynamo", CASES["dynamo_inductor"][0])
    run = launch("lora", tmp_path / "out", "--max-steps", "2", "--batch-size", "2", "--eval-every", "0",
                 config=config, mixed_precision="no")
    assert run.returncode == 0, run.output[-3000:]
    assert run.run_json()["arguments"]["compile"] is True
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("text, message", [
    ('{"zero_optimization": {"stage": 2}, "train_batch_size": 8, "train_batch_size": 16}', "`train_batch_size` is set twice"),
    ('[{"zero_optimization": {"stage": 2}}]', 'holds a JSON list, not an object of DeepSpeed settings; write it as {"zero'),
])
def test_the_launch_reads_a_deepspeed_json_as_strictly_as_check_config(text, message, tmp_path, capsys):
    """The recipe reads --deepspeed_config_file itself (not through check_config): the same refusals."""
    from common.launching.deepspeed_config import deepspeed_source

    path = tmp_path / "user.json"
    path.write_text(text)
    with pytest.raises(Refusal):
        deepspeed_source({"ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)})
    assert message in capsys.readouterr().err


def test_what_deepspeed_would_refuse_in_the_engines_config_is_one_line_before_the_model_loads(tmp_path):
    """DeepSpeed's own config classes read the exact config the engine would start with, before the model loads
    (a removed section, even disabled, is refused by DeepSpeed only at prepare), and check_config says the same."""
    config = write(tmp_path, "removed_amp", zero(2, amp={"enabled": False}))
    run = launch("lora", tmp_path / "out", "--max-steps", "1", config=config, mixed_precision=None)
    assert run.returncode != 0
    lines = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: DeepSpeed refuses the config it would start with "
                                                   "(removed_amp.json with the recipe's settings): "), run.output[-3000:]
    assert "Apex" in lines[0]
    assert_no_traceback_of_ours(run.output)
    assert not (tmp_path / "out" / "run.json").exists()
    with pytest.raises(Refusal, match="DeepSpeed refuses the config it would start with"):
        check_config.check(config, "lora", num_processes=2, on_gpu=False)
