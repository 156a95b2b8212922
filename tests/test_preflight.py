"""Launches that cannot work stop before the model loads, with one line naming the fix."""

from __future__ import annotations

import argparse
import os
import sys
from collections import namedtuple
from unittest import mock

import pytest

from conftest import CONFIGS, REPO, TINY_MODEL, assert_no_traceback_of_ours, launch

sys.path.insert(0, str(REPO / "recipes"))
from common.launching import preflight, settle  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.data.checked_rows import load_splits  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402


@pytest.fixture(autouse=True)
def restored_environment():
    """The checks translate the launch environment in place (FSDP1 -> FSDP2); undo it after each test."""
    with mock.patch.dict(os.environ):
        yield


def refusal_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def test_model_parallel_with_two_processes_is_refused(tmp_path):
    run = launch("lora", tmp_path / "out", "--max-steps", "1", config="model_parallel", processes=2)
    assert run.returncode != 0, run.output[-3000:]
    [line] = refusal_lines(run.output)
    assert "ONE process" in line and "fsdp.yaml" in line and "ddp.yaml" in line
    assert_no_traceback_of_ours(run.output)
    assert not (tmp_path / "out" / "run.json").exists()


def launched_with(config: str, processes: int):
    """The environment `accelerate launch --config_file accelerate_configs/<config>.yaml` gives rank 0."""
    sys.path.insert(0, str(REPO / "scripts"))
    import check_config

    return mock.patch.dict(os.environ, check_config.launcher_environment(CONFIGS / f"{config}.yaml", processes))


def test_eight_bit_under_fsdp_is_refused(tmp_path):
    args = parse_args(recipe_flags("qlora"), ["--bits", "8", "--max-steps", "1", "--output-dir", str(tmp_path / "out")])
    with launched_with("fsdp", 2), pytest.raises(Refusal) as refusal:
        settle.settle_launch(args, "qlora")
    assert "8-bit" in str(refusal.value) and "--bits 4" in str(refusal.value)


def test_missing_dataset_is_refused(tmp_path):
    args = parse_args(recipe_flags("full"), ["--dataset", str(tmp_path / "nope.jsonl"), "--output-dir", str(tmp_path / "out")])
    with launched_with("ddp", 2), pytest.raises(Refusal, match="nope.jsonl does not exist"):
        settle.settle_launch(args, "full")


# The checks themselves, in-process: each refusal names the problem and the fix.


def recipe_args(*argv: str) -> argparse.Namespace:
    return parse_args(recipe_flags("lora"), list(argv))


@pytest.mark.parametrize("argv, message", [
    (["--max-length", "65536"], "--max-length 65536 is beyond the model's context of 32768 tokens; pass --max-length 32768"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--grad-accum", "-1"], "--grad-accum must be >= 1, got -1"),
    (["--max-steps", "-5"], "--max-steps must be >= 0, got -5"),
    (["--max-steps", "0", "--epochs", "0"], "nothing to train: give --max-steps N or --epochs N"),
    (["--model", "/no/such/model"], "--model /no/such/model does not exist"),
    (["--gradient-checkpointing", "-2"], "--gradient-checkpointing must be >= 0, got -2"),
    (["--dataloader-workers", "-1"], "--dataloader-workers must be >= 0, got -1"),
    # Neither liger-kernel nor flash-attn is installed here, and there is no GPU.
    (["--liger"], "--liger needs Liger's kernels: `pip install liger-kernel`, or drop --liger"),
    (["--attention", "flash_attention_2"], "--attention flash_attention_2 needs `pip install flash-attn`"),
])
def test_bad_arguments_are_refused_with_the_fix(argv, message, tmp_path):
    with pytest.raises(Refusal, match=message.replace("(", r"\(")):
        settle.settle_launch(recipe_args("--output-dir", str(tmp_path), *argv), "lora")


def test_not_enough_disk_for_a_checkpoint_is_refused(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(Refusal, match="has 0.0 MiB free but this run writes about .*; free some disk or choose another --output-dir"):
        settle.settle_launch(recipe_args("--output-dir", str(tmp_path / "new" / "run"), "--save-every", "10"), "full")


def test_deepspeed_accumulation_that_disagrees_with_the_recipe_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    with pytest.raises(Refusal, match="the accelerate config sets gradient_accumulation_steps = 1 but --grad-accum is 4; "
                                      "pass the same value, or set \"gradient_accumulation_steps\": \"auto\""):
        settle.settle_launch(recipe_args("--output-dir", str(tmp_path), "--grad-accum", "4"), "lora")


def test_fsdp_activation_checkpointing_twice_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    with pytest.raises(Refusal, match="activation checkpointing is asked twice"):
        settle.settle_launch(recipe_args("--output-dir", str(tmp_path), "--gradient-checkpointing"), "lora")


def test_an_empty_dataset_is_refused(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(Refusal, match="is an empty file"):
        load_splits(str(empty), seed=0)


def test_random_launches_get_a_clean_start_or_one_refusal(tmp_path, monkeypatch, capsys):
    """Many combinations of strategy settings and flags: every one either passes the checks or
    is refused with our one line; no other exception, and every rank reaches the same verdict."""
    import random

    rng = random.Random(0)
    environments = [
        {}, {"ACCELERATE_USE_FSDP": "true"}, {"ACCELERATE_USE_FSDP": "true", "FSDP_ACTIVATION_CHECKPOINTING": "true"},
        {"ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": "true"},
        {"ACCELERATE_USE_FSDP": "true", "FSDP_RESHARD_AFTER_FORWARD": "false"},
        {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
        {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2"},
        {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_GRADIENT_CLIPPING": "0.5"},
    ]
    flag_choices = {
        "--batch-size": ["0", "1", "8", "-2"], "--grad-accum": ["1", "2", "0"], "--max-length": ["16", "1024", "50000"],
        "--max-steps": ["0", "5", "-1"], "--epochs": ["0", "1", "0.5"], "--max-grad-norm": ["1.0", "0.5"],
        "--model": [None, "/missing/model", "org/some-hub-model"], "--dataset": [None, "/missing/data.jsonl"],
        "--lora-targets": ["all-linear", "q_proj,v_proj"],
    }
    verdicts = 0
    for _ in range(150):
        env = rng.choice(environments)
        argv = ["--output-dir", str(tmp_path / "out")]
        for flag, values in flag_choices.items():
            value = rng.choice(values)
            if value is not None:
                argv += [flag, value]
        if rng.random() < 0.3:
            argv.append("--gradient-checkpointing")
        recipe = rng.choice(["full", "lora", "qlora"])
        outcomes = []
        for rank in ("0", "1"):
            with monkeypatch.context() as patch, mock.patch.dict(os.environ):  # the checks may rewrite it
                for key, value in env.items():
                    patch.setenv(key, value)
                patch.setenv("RANK", rank)
                try:
                    settle.settle_launch(recipe_args(*argv), recipe)
                    outcomes.append("ok")
                except Refusal as refusal:
                    assert "\n" not in refusal.message
                    outcomes.append(refusal.message)
        assert outcomes[0] == outcomes[1], (env, argv)
        verdicts += outcomes[0] != "ok"
    refused_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(refused_lines) == verdicts  # printed once (by rank 0), one line each
    assert 0 < verdicts < 150


@pytest.mark.parametrize("fields, file_config, argv, message", [
    ("mixed_precision,zero_stage", {}, [], "sets mixed_precision, zero_stage beside deepspeed_config_file; move them into"),
    ("", {"optimizer": {"type": "Lamb"}}, [], "asks for a DeepSpeed Lamb optimizer; the recipes train with AdamW"),
    ("", {"gradient_accumulation_steps": 8}, ["--grad-accum", "1"],
     "sets gradient_accumulation_steps = 8 but --grad-accum is 1"),
    ("", {"gradient_clipping": 0.3}, ["--max-grad-norm", "1.0"], "sets gradient_clipping = 0.3 but --max-grad-norm is 1.0"),
])
def test_a_deepspeed_config_file_that_contradicts_the_launch_is_refused(fields, file_config, argv, message, tmp_path,
                                                                        monkeypatch):
    import json

    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps({"zero_optimization": {"stage": 2}, **file_config}))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ds_file))
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", fields)
    with pytest.raises(Refusal, match=message):
        settle.settle_launch(recipe_args("--output-dir", str(tmp_path / "out"), *argv), "lora")
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "")
    ds_file.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto"}))
    settle.settle_launch(recipe_args("--output-dir", str(tmp_path / "out"), *argv), "lora")  # a clean file passes


# Tensor parallel: what it cannot split is refused before the model loads, naming the config to use.

def launched_with_mesh(config: str, processes: int, tp: int, shard: int = 1):
    sys.path.insert(0, str(REPO / "scripts"))
    import check_config

    env = check_config.launcher_environment(CONFIGS / f"{config}.yaml", processes)
    env.update(PARALLELISM_CONFIG_TP_SIZE=str(tp), PARALLELISM_CONFIG_DP_SHARD_SIZE=str(shard))
    return mock.patch.dict(os.environ, env)


@pytest.mark.parametrize("recipe, config, mesh, argv, message", [
    ("qlora", "tp", (2, 2, 1), [], "4-bit and 8-bit weights cannot be split by tensor parallel; QLoRA shards with "
                                   "accelerate_configs/fsdp.yaml"),
    ("lora", "fsdp_tp", (4, 2, 2), [], "LoRA cannot run FSDP x TP"),
    ("lora", "tp", (2, 2, 1), [], "LoRA on the row-split layers down_proj, o_proj fails under tensor parallel"),
    ("lora", "tp", (2, 2, 1), ["--lora-targets", "q_proj,o_proj"], "pass --lora-targets gate_proj,k_proj,q_proj,"
                                                                   "up_proj,v_proj"),
    ("lora", "tp", (2, 2, 1), ["--lora-targets", "q_proj,lm_head"], "LoRA on lm_head fails under tensor parallel"),
    ("full", "tp", (4, 4, 1), [], "the tiny model's 4 query / 2 key-value heads"),
])
def test_what_tensor_parallel_cannot_split_is_refused(recipe, config, mesh, argv, message, tmp_path):
    processes, tp, shard = mesh
    args = parse_args(recipe_flags(recipe), [*argv, "--output-dir", str(tmp_path / "out")])
    with launched_with_mesh(config, processes, tp, shard), pytest.raises(Refusal) as refusal:
        settle.settle_launch(args, recipe)
    assert message.replace("the tiny model's", "") in str(refusal.value).replace(str(args.model), ""), refusal.value


def test_lora_on_the_column_split_layers_passes_the_checks(tmp_path):
    args = parse_args(recipe_flags("lora"), ["--lora-targets", "q_proj,v_proj", "--output-dir", str(tmp_path / "out")])
    with launched_with_mesh("tp", 2, 2):
        _, launch = settle.settle_launch(args, "lora")
    assert (launch.kind, launch.tensor_parallel, launch.data_parallel_size) == ("tensor_parallel", 2, 1)


def test_check_config_answers_for_what_tensor_parallel_can_split():
    """scripts/check_config.py on the shipped files: the recipe's split checks too, not only the file's."""
    sys.path.insert(0, str(REPO / "scripts"))
    import check_config

    assert check_config.check(CONFIGS / "fsdp_tp.yaml", "full", on_gpu=False)[-1] == \
        "ok: full runs as fsdp_tp on 4 process(es), precision bf16"
    with pytest.raises(Refusal, match="4-bit and 8-bit weights cannot be split by tensor parallel"):
        check_config.check(CONFIGS / "fsdp_tp.yaml", "qlora", on_gpu=False)
    with pytest.raises(Refusal, match="splits the attention heads"):  # the bundled model: 2 key-value heads, 4-way
        check_config.check(CONFIGS / "tp.yaml", "full", on_gpu=False)


def test_the_bundled_model_is_rebuilt_when_its_config_changes(tmp_path, monkeypatch):
    """A model built from an older data/tiny-llama-config.json (another context, another shape) is built again;
    a key the installed transformers saves under another name is no reason to (else every start rebuilt it)."""
    import json
    import shutil

    from common.model import model_config

    built = tmp_path / "tiny-llama"
    shutil.copytree(TINY_MODEL, built)
    monkeypatch.setattr(model_config, "DEFAULT_MODEL", built)
    config = json.loads((built / "config.json").read_text())
    assert not model_config.default_model_needs_building()
    (built / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    assert model_config.default_model_needs_building()
    renamed = {key: value for key, value in config.items() if key != "rope_parameters"}
    (built / "config.json").write_text(json.dumps({**renamed, "rope_scaling": config["rope_parameters"]}))
    assert not model_config.default_model_needs_building()
