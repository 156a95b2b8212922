"""Config files users already have run the recipes as written, or are refused in one line.

The fixtures in tests/fixtures/user_configs/ are verbatim copies of the accelerate configs and
DeepSpeed JSONs that alignment-handbook, TRL, PEFT's examples, axolotl and accelerate's own
examples ship (SOURCES.md names each file's repository, path and commit). Every one is checked
the way `accelerate launch` reads it (scripts/check_config.py, in-process); one of each kind is
launched for real, across the three recipes.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import (REPO, assert_no_traceback_of_ours, assert_the_refusal_ends_the_output, launch, launch_command,
                      launch_env, long_test)

sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "recipes"))
import check_config  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "user_configs"
FP16_ON_CPU = "trains in fp16, which DeepSpeed cannot do on CPU"
# file -> what the recipe does with it on this CPU machine, and on a GPU machine: the planner's name of
# the strategy that runs, or the start of the one-line refusal.
EXPECTED = {
    "alignment-handbook__ddp.yaml": ("ddp", "ddp"),
    "alignment-handbook__fsdp.yaml": ("fsdp_full_shard", "fsdp_full_shard"),
    "alignment-handbook__zero3.yaml": ("zero3", "zero3"),
    "trl__single_gpu.yaml": ("ddp", "ddp"),
    "trl__fsdp1.yaml": ("fsdp_full_shard", "fsdp_full_shard"),
    "trl__fsdp2.yaml": ("fsdp_full_shard", "fsdp_full_shard"),
    "trl__fsdp_qlora.yaml": ("fsdp_offload", "fsdp_offload"),
    "trl__deepspeed_zero1.yaml": ("zero1", "zero1"),
    "trl__deepspeed_zero2.yaml": ("zero2", "zero2"),
    "trl__deepspeed_zero3.yaml": ("zero3", "zero3"),
    "trl__context_parallel_2gpu.yaml": ("error: context parallel",) * 2,
    # DeepSpeed's own key in accelerate's YAML section, which accelerate drops (in a DeepSpeed JSON it is read)
    "trl__alst_ulysses_4gpu.yaml": ("error: trl__alst_ulysses_4gpu.yaml: `seq_parallel_communication_data_type` in "
                                    "deepspeed_config is not an accelerate setting",) * 2,
    "peft__fsdp_config.yaml": ("fsdp_full_shard", "fsdp_full_shard"),
    "peft__fsdp_config_qlora.yaml": ("fsdp_offload", "fsdp_offload"),
    "peft__deepspeed_config.yaml": ("zero3", "zero3"),
    "peft__deepspeed_config_z3_qlora.yaml": ("zero3", "zero3"),
    "peft__accelerate_ds_zero3_cpu_offload_config.yaml": ("zero3", "zero3"),
    "axolotl__zero1.json": ("zero1", "zero1"),
    "axolotl__zero1_torch_compile.json": ("zero1", "zero1"),
    "axolotl__zero2.json": ("zero2", "zero2"),
    "axolotl__zero3.json": ("zero3", "zero3"),
    "axolotl__zero3_bf16.json": ("zero3", "zero3"),
    "axolotl__zero3_bf16_cpuoffload_all.json": ("zero3_offload", "zero3_offload"),
    "axolotl__zero3_bf16_cpuoffload_params.json": ("zero3_offload", "zero3_offload"),
    "accelerate__fsdp.yaml": ("fsdp_full_shard", "fsdp_full_shard"),
    # 2 replicas x 2 shards x 2-way TP: hybrid sharding needs GPUs; on GPUs, replicas x TP are refused
    "accelerate__tp_hsdp.yaml": ("error: hybrid sharding needs GPUs",
                                 "error: parallelism_config_dp_replicate_size 2 with tensor parallel is not supported"),
    # WarmupDecayLR schedulers (run as written); fp16, which DeepSpeed runs on GPUs only
    "accelerate__deepspeed.yaml": (f"error: ../deepspeed_config_templates/zero_stage1_config.json {FP16_ON_CPU}", "zero1"),
    "accelerate__zero_stage1_config.json": (f"error: {{path}} {FP16_ON_CPU}", "zero1"),
    "accelerate__zero_stage3_offload_config.json": (f"error: {{path}} {FP16_ON_CPU}", "zero3_offload"),
    # WarmupLR schedulers with "auto" values (transformers' DeepSpeed docs and tests, LLaVA)
    "transformers__ds_config_zero2.json": ("zero2", "zero2"),
    "llava__zero3_offload.json": ("zero3_offload", "zero3_offload"),
    "llama-factory__ds_z2_autotp_config.json": ("error: {path} asks for DeepSpeed AutoTP",) * 2,
    "accelerate__sp-alst.accelerate-config.yml": ("zero3", "zero3"),
    "accelerate__sp-alst.ds-config.json": ("zero3", "zero3"),
}


def test_every_fixture_has_an_expectation_and_a_source():
    files = {path.name for path in FIXTURES.iterdir() if path.suffix in (".yaml", ".yml", ".json")}
    assert files == set(EXPECTED)
    sources = (FIXTURES / "SOURCES.md").read_text()
    assert all(f"`{name}`" in sources for name in files)


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory):
    """The fixtures laid out as their projects have them, so relative `deepspeed_config_file` paths resolve."""
    root = tmp_path_factory.mktemp("user")
    (root / "configs").mkdir()
    (root / "deepspeed_config_templates").mkdir()
    for path in FIXTURES.glob("*__*"):
        shutil.copy(path, root / "configs" / path.name)
    shutil.copy(FIXTURES / "accelerate__zero_stage1_config.json",
                root / "deepspeed_config_templates" / "zero_stage1_config.json")
    shutil.copy(FIXTURES / "accelerate__sp-alst.ds-config.json", root / "configs" / "sp-alst.ds-config.json")
    return root / "configs"


@pytest.mark.parametrize("on_gpu", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_file_runs_or_is_refused_in_one_line(name, on_gpu, user_folder, monkeypatch, capsys):
    monkeypatch.chdir(user_folder)  # where the launcher would resolve the file's relative paths
    expected = EXPECTED[name][on_gpu].replace("{path}", str(user_folder / name))
    written = {} if name.endswith(".json") else yaml.safe_load((user_folder / name).read_text())
    processes = None if written.get("num_processes") == 1 else 2  # one-process files run as written
    try:
        lines = check_config.check(user_folder / name, "lora", num_processes=processes, on_gpu=on_gpu)
    except Refusal:
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1, lines
    verdict = lines[-1]
    if expected.startswith("error: "):
        assert verdict.startswith(expected), verdict
    else:
        assert verdict.startswith(f"ok: lora runs as {expected} on "), lines


def test_fsdp1_files_say_what_they_translate(user_folder, monkeypatch):
    monkeypatch.chdir(user_folder)
    [note, verdict] = check_config.check(user_folder / "trl__fsdp1.yaml", "lora", num_processes=2, on_gpu=False)
    assert note.startswith("config: FULL_SHARD -> FSDP2 with reshard_after_forward true;"), note
    assert "prefetch" in note and "use_orig_params" in note
    assert "precision bf16" in verdict


def test_a_typo_inside_fsdp_config_names_the_closest_key(tmp_path, capsys):
    config = yaml.safe_load((FIXTURES / "trl__fsdp2.yaml").read_text())
    config["fsdp_config"]["fsdp_reshard_after_foward"] = config["fsdp_config"].pop("fsdp_reshard_after_forward")
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(Refusal, match="`fsdp_reshard_after_foward` in fsdp_config is not an accelerate setting"):
        check_config.check(path, "lora", num_processes=2, on_gpu=False)
    assert "did you mean `fsdp_reshard_after_forward`?" in capsys.readouterr().err


def test_an_unknown_top_level_key_names_the_closest_key(tmp_path, capsys):
    config = yaml.safe_load((FIXTURES / "trl__fsdp2.yaml").read_text())
    config["mixed_precison"] = config.pop("mixed_precision")
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(config))
    assert check_config.main([str(path)]) == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert "`mixed_precison` at the top level" in line and "did you mean `mixed_precision`?" in line


# Real launches: one of each kind, through `accelerate launch` exactly as the file is written
# (only --num_processes 2: this machine has 2 cores), across the three recipes.
LAUNCHED = {
    # recipe, file: what run.json must show. These files are written the way `accelerate config`
    # writes them (every default key included); the three recipes share them.
    ("lora", "trl__fsdp1.yaml"): {"distributed_type": "FSDP", "precision": "bf16", "reshard": True,
                                  "note": "config: FULL_SHARD -> FSDP2", "state_dict_type": "FULL_STATE_DICT"},
    ("qlora", "peft__fsdp_config_qlora.yaml"): {"distributed_type": "FSDP", "precision": "no", "reshard": True,
                                                "note": "config: FULL_SHARD -> FSDP2", "offload": "CPUOffloadPolicy"},
    ("qlora", "axolotl__zero3_bf16.json"): {"distributed_type": "DEEPSPEED", "precision": "bf16", "zero_stage": 3,
                                            "note": "config: precision bf16 (its bf16.enabled)"},
    ("full", "peft__deepspeed_config.yaml"): {"distributed_type": "DEEPSPEED", "precision": "bf16", "zero_stage": 3,
                                              "note": "config: --grad-accum 4 (its gradient_accumulation_steps)",
                                              "grad_accum": 4},
}


# Every run launches the LoRA and full-fine-tuning files; the two QLoRA ones (~50 s) join the long run.
@pytest.mark.parametrize("recipe, name", [
    pytest.param(recipe, name, marks=long_test) if recipe == "qlora" else (recipe, name) for recipe, name in LAUNCHED
], ids=lambda value: str(value).split("__")[-1])
def test_user_config_file_trains_as_written(recipe, name, tmp_path):
    expected = LAUNCHED[recipe, name]
    run = launch(recipe, tmp_path / "out", "--max-steps", "2", "--batch-size", "2", "--log-every", "1",
                 config=str(FIXTURES / name), mixed_precision=None)
    assert run.returncode == 0, run.output[-3000:]
    notes = [line for line in run.output.splitlines() if line.startswith("config: ")]
    assert notes == ([] if "note" not in expected else [notes[0]]), run.output[-3000:]  # once, from rank 0
    assert not notes or notes[0].startswith(expected["note"]), notes
    ran = run.run_json()
    assert (ran["distributed_type"], ran["num_processes"]) == (expected["distributed_type"], 2)
    assert ran["mixed_precision"] == ran["strategy"]["precision"] == expected["precision"]
    if ran["distributed_type"] == "FSDP":
        fsdp = ran["strategy"]["fsdp"]
        assert (fsdp["version"], fsdp["reshard_after_forward"]) == (2, expected["reshard"])
        assert fsdp["cpu_offload"] == expected.get("offload", "OffloadPolicy")
        assert fsdp["state_dict_type"] == expected.get("state_dict_type", "SHARDED_STATE_DICT")
        assert fsdp["param_dtype"] == {"bf16": "bfloat16", "no": None}[expected["precision"]]  # FSDP2 computes in it
    if ran["distributed_type"] == "DEEPSPEED":
        deepspeed = ran["strategy"]["deepspeed"]
        assert deepspeed["zero_stage"] == expected["zero_stage"]
        assert deepspeed["gradient_accumulation_steps"] == ran["arguments"]["grad_accum"] == expected.get("grad_accum", 1)
    if ran["distributed_type"] == "FSDP" or expected.get("zero_stage") == 3:
        held = ran["parameters"]["held_by_rank"]
        assert max(held) < 0.6 * ran["parameters"]["total"], held  # really sharded over the 2 ranks
    saved = "model/model.safetensors" if recipe == "full" else "adapter/adapter_model.safetensors"
    assert (tmp_path / "out" / saved).is_file()


@long_test  # ~12 min; each run of the suite launches the LoRA and full files above
@pytest.mark.parametrize("name", sorted(name for name in EXPECTED if name != "accelerate__sp-alst.ds-config.json"))
def test_every_fixture_trains_or_is_refused(name, user_folder, tmp_path, monkeypatch):
    """Every file launched for real, the recipes taking turns; relative paths resolve as in their projects."""
    recipe = ("full", "lora", "qlora")[sorted(EXPECTED).index(name) % 3]
    monkeypatch.chdir(user_folder)
    written = {} if name.endswith(".json") else yaml.safe_load((user_folder / name).read_text())
    processes = 1 if written.get("num_processes") == 1 else 2  # the files ask for 8; this machine has 2 cores
    command = launch_command(recipe, tmp_path / "out", "--max-steps", "2", "--batch-size", "2",
                             config=str(user_folder / name), processes=processes, mixed_precision=None)
    done = subprocess.run(command, cwd=user_folder, capture_output=True, text=True, timeout=900, env=launch_env())
    output = done.stdout + done.stderr
    expected = EXPECTED[name][0].replace("{path}", name)
    if expected.startswith("error: "):
        lines = [line for line in output.splitlines() if line.startswith("error: ")]
        assert done.returncode != 0 and len(lines) == 1 and expected.split(" ")[-1] in lines[0], output[-3000:]
        if processes > 1:  # through torch's launcher, whose report comes last (FSDP, DeepSpeed, TP files alike)
            assert_the_refusal_ends_the_output(output, lines[0])
        return
    assert done.returncode == 0, output[-3000:]
    ran = json.loads((tmp_path / "out" / "run.json").read_text())
    kinds = {"ddp": "MULTI_CPU" if processes > 1 else "NO", "zero": "DEEPSPEED", "fsdp": "FSDP"}
    assert (ran["distributed_type"], ran["num_processes"]) == (kinds[expected[:4].rstrip("_123")], processes)


def test_a_deepspeed_scheduler_section_trains_as_written(tmp_path):
    """transformers' ZeRO-2 JSON (WarmupLR, every value "auto"): DeepSpeed's log warm-up over
    --warmup-ratio of the steps up to --lr, then constant, said in the config line and in run.json."""
    run = launch("lora", tmp_path / "out", "--max-steps", "6", "--batch-size", "2", "--warmup-ratio", "0.5",
                 "--lr", "1e-3", config=str(FIXTURES / "transformers__ds_config_zero2.json"), mixed_precision=None)
    assert run.returncode == 0, run.output[-3000:]
    [note] = [line for line in run.output.splitlines() if line.startswith("config: ")]
    assert "scheduler WarmupLR runs as the file asks (from the recipe: warmup_min_lr 0, warmup_max_lr --lr" in note
    ran = run.run_json()
    assert ran["arguments"]["deepspeed_scheduler"]["ran"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                              "warmup_num_steps": 3}
    # the rate after step k (logged) is the one step k + 1 runs at: DeepSpeed's iteration k - 1
    expected = [1e-3 * (math.log(k) / math.log(3) if k - 1 < 3 else 1.0) for k in range(1, 7)]
    assert [record["lr"] for record in run.metrics()] == pytest.approx(expected)


def with_typo(tmp_path) -> str:
    """TRL's fsdp2.yaml with `fsdp_reshard_after_forward` misspelt: accelerate alone would run full shard."""
    config = yaml.safe_load((FIXTURES / "trl__fsdp2.yaml").read_text())
    config["fsdp_config"]["fsdp_reshard_after_foward"] = False
    del config["fsdp_config"]["fsdp_reshard_after_forward"]
    path = tmp_path / "fsdp2_typo.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_a_typo_in_the_launched_file_is_refused_before_the_model_loads(tmp_path):
    """The recipe finds the file in the launcher's command line (context parallel and the other
    refusals that the launcher's environment shows are checked in-process above)."""
    refusal = ("error: fsdp2_typo.yaml: `fsdp_reshard_after_foward` in fsdp_config is not an accelerate setting "
               "(accelerate would ignore it); did you mean `fsdp_reshard_after_forward`?")
    run = launch("lora", tmp_path / "out", "--max-steps", "1", config=with_typo(tmp_path), mixed_precision=None)
    assert run.returncode != 0
    lines = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith(refusal), run.output[-3000:]
    assert_no_traceback_of_ours(run.output)
    assert not (tmp_path / "out" / "run.json").exists()


def test_check_config_runs_the_strategys_checks_against_the_model(tmp_path):
    """A file the launch would refuse is refused by check_config too (it skipped FSDP's layer classes)."""
    config = {"distributed_type": "FSDP", "mixed_precision": "no", "num_processes": 2,
              "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_transformer_layer_cls_to_wrap": "MistralDecoderLayer"}}
    path = tmp_path / "wrong_layer.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(Refusal, match="names MistralDecoderLayer, which this llama model does not have"):
        check_config.check(path, "lora", num_processes=2, on_gpu=False)
    config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = ["LlamaDecoderLayer", "Embedding"]  # a YAML list
    path.write_text(yaml.safe_dump(config))
    note, verdict = check_config.check(path, "lora", num_processes=2, on_gpu=False)
    assert "fsdp_transformer_layer_cls_to_wrap list -> LlamaDecoderLayer,Embedding" in note
    assert verdict.startswith("ok: lora runs as fsdp_full_shard")


@pytest.mark.parametrize("text, message", [
    ("distributed_type: multi_gpu\nnum_processes: 2\n", "distributed_type `multi_gpu` must be written in capitals"),
    ("distributed_type: MULTI_GPU\nnum_processes: '2'\n", "num_processes is '2'; write a whole number without quotes"),
])
def test_what_accelerate_launch_would_stop_at_is_named(text, message, tmp_path):
    path = tmp_path / "file.yaml"
    path.write_text(text)
    with pytest.raises(Refusal, match=message):
        check_config.check(path, "lora", on_gpu=False)


def test_a_deepspeed_json_without_a_zero_section_is_read_as_deepspeed(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"bf16": {"enabled": true}, "train_micro_batch_size_per_gpu": 4}')
    assert check_config.is_deepspeed_json(path)
    with pytest.raises(Refusal, match="has no `zero_optimization` section"):
        check_config.check(path, "lora", on_gpu=False)
