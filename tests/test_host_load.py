"""Host RAM at load: the planner's copies of the weights per machine, the `plan:` line that says it,
and the refusal, before the model loads, of a launch whose weights outgrow the machine's RAM."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import save_file

from conftest import REPO, assert_no_traceback_of_ours, launch

sys.path.insert(0, str(REPO / "recipes"))
import planner  # noqa: E402
from common.launching import memory_plan  # noqa: E402
from common.refusal import Refusal  # noqa: E402

GiB = 2**30
ONE_COPY = ["fsdp_full_shard", "fsdp_grad_op", "fsdp_offload", "zero3", "zero3_offload", "tp", "pipeline"]


@pytest.fixture(scope="module")
def shape():
    return planner.load_shape("codellama-34b")


def test_each_ddp_process_loads_a_replica_and_sharded_strategies_one_copy(shape):
    replica = shape.parameters * 2  # the bf16 frozen base of LoRA
    ddp = planner.load_bytes_per_machine(shape, "lora", "ddp", gpus=4)
    assert (ddp["bytes"], ddp["copies"], ddp["processes"]) == (4 * replica, 4, 4) and ddp["one_copy"]
    for strategy in ONE_COPY:
        load = planner.load_bytes_per_machine(shape, "lora", strategy, gpus=4)
        assert (load["bytes"], load["copies"]) == (replica, 1), strategy


def test_full_fine_tuning_loads_fp32_and_a_machine_holds_only_its_processes(shape):
    full = planner.load_bytes_per_machine(shape, "full", "ddp", gpus=16, gpus_per_machine=8)
    assert full["processes"] == 8 and full["bytes"] == 8 * shape.parameters * 4
    assert planner.load_bytes_per_machine(shape, "full", "model_parallel", gpus=4)["bytes"] == shape.parameters * 4
    # DeepSpeed's bf16: the trained weights load in bf16 (its optimizer keeps their float32 masters)
    assert planner.load_bytes_per_machine(shape, "full", "zero1", gpus=16, gpus_per_machine=8)["bytes"] == \
        8 * shape.parameters * 2


def test_switches_that_make_every_process_read_are_named(shape):
    every = planner.load_bytes_per_machine(shape, "lora", "fsdp_full_shard", gpus=4, every_process_reads=True)
    assert every["copies"] == 4 and "fsdp_cpu_ram_efficient_loading: true" in every["one_copy"]
    every = planner.load_bytes_per_machine(shape, "lora", "zero3", gpus=4, every_process_reads=True)
    assert every["copies"] == 4 and "zero3_init_flag: true" in every["one_copy"]


def test_qlora_is_a_4_bit_copy_per_cpu_process_and_the_files_on_gpus(shape):
    cpu = planner.load_bytes_per_machine(shape, "qlora", "fsdp_full_shard", gpus=2, on_gpu=False)
    four_bit = planner.model_bytes_as_loaded(shape, "qlora")
    assert cpu["copies"] == 2 and cpu["bytes"] == 2 * four_bit
    assert shape.parameters * 0.5 < four_bit < shape.parameters * 2 / 3  # NF4 linears, bf16 embedding and head
    gpu = planner.load_bytes_per_machine(shape, "qlora", "ddp", gpus=4)
    assert gpu["copies"] == 1 and gpu["bytes"] == shape.parameters * 2


def test_a_vision_language_models_tower_and_projector_load_with_it_in_the_dtype_of_its_floats(shape):
    """Never quantized: QLoRA's vision side loads in bf16 beside its 4-bit linears; full fine-tuning's in fp32
    (DeepSpeed's bf16: 2 bytes), as its language model's."""
    side = planner.VisionShape(tower=600_000_000, projector=40_000_000, unread=10_000_000, hidden=1024, ffn=4096,
                               layers=24, patch_values=588, patches_per_token=1.0)
    held = side.tower + side.projector + side.unread
    for method, strategy, per in (("lora", "ddp", 2), ("full", "ddp", 4), ("full", "zero1", 2),
                                  ("lora", "fsdp_full_shard", 2)):
        text = planner.load_bytes_per_machine(shape, method, strategy, gpus=4)
        both = planner.load_bytes_per_machine(shape, method, strategy, gpus=4, vision=side)
        assert both["bytes"] - text["bytes"] == text["copies"] * per * held, (method, strategy)
    cpu = planner.load_bytes_per_machine(shape, "qlora", "ddp", gpus=2, on_gpu=False, vision=side)
    assert cpu["bytes"] == 2 * (planner.model_bytes_as_loaded(shape, "qlora") + 2 * held)
    gpu = planner.load_bytes_per_machine(shape, "qlora", "ddp", gpus=4, vision=side)
    assert gpu["bytes"] == (shape.parameters + held) * 2  # the files' bf16 pages, once


def test_the_refusal_names_the_fix_and_a_fitting_launch_passes(shape):
    ddp = planner.load_bytes_per_machine(shape, "lora", "ddp", gpus=4)
    with pytest.raises(Refusal) as refusal:
        memory_plan.check_host_ram(ddp, 200 * GiB, "codellama")
    assert "4 copies" in str(refusal.value) and "fsdp.yaml" in str(refusal.value) and "200.00 GiB" in str(refusal.value)
    memory_plan.check_host_ram(ddp, ddp["bytes"], "codellama")  # exactly enough: no refusal
    memory_plan.check_host_ram(ddp, None, "codellama")  # RAM unknown: no refusal
    one = planner.load_bytes_per_machine(shape, "lora", "fsdp_full_shard", gpus=4)
    with pytest.raises(Refusal, match="a machine with more RAM"):
        memory_plan.check_host_ram(one, 10 * GiB, "codellama")


def test_machine_ram_is_read():
    ram = memory_plan.machine_ram_bytes()
    assert ram is not None and 1 * GiB < ram < 64 * 1024 * GiB


@pytest.fixture(scope="module")
def huge_model(tmp_path_factory):
    """A 69B Llama's config, the bundled tokenizer and a stand-in weights file: a launch must stop before it reads it."""

    folder = tmp_path_factory.mktemp("llama-69b")
    config = json.loads((REPO / "data" / "tiny-llama-config.json").read_text())
    config.update(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, head_dim=128, vocab_size=32000)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"lm_head.weight": torch.zeros(1)}, str(folder / "model.safetensors"))
    for file in (REPO / "data" / "tokenizer").iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def test_a_launch_whose_weights_outgrow_the_machine_stops_before_loading(huge_model, tmp_path):
    run = launch("lora", tmp_path / "out", "--model", str(huge_model), "--max-steps", "1", config="ddp", processes=2)
    assert run.returncode != 0, run.output[-3000:]
    [line] = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert "host RAM" in line and "2 copies" in line and "fsdp.yaml" in line, line
    assert_no_traceback_of_ours(run.output)
    assert not (tmp_path / "out" / "run.json").exists()


def test_the_plan_line_says_the_host_ram_to_load(tmp_path):
    run = launch("lora", tmp_path / "out", "--max-steps", "1", config="fsdp", processes=2)
    assert run.returncode == 0, run.output[-3000:]
    [line] = [line for line in run.output.splitlines() if line.startswith("plan: ")]
    tiny = planner.model_bytes_as_loaded(planner.load_shape("tiny-llama"), "lora", precision="fp32")
    assert f"host RAM to load the weights: {memory_plan.size(tiny)} on this machine" in line, line
    assert "each process reads its shards from the files" in line, line


def test_plan_py_prints_the_host_ram_of_each_recommendation(capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    import plan

    assert plan.main(["--model", "codellama-34b", "--gpus", "4", "--batch-size", "4", "--grad-accum", "4"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Host RAM to load the weights")]
    shape = planner.load_shape("codellama-34b")
    assert lines, "no host RAM line"
    for line in lines:
        strategy, gpus = line.split(", ")[1].split(":")[0].split(" on ")
        load = planner.load_bytes_per_machine(shape, "lora", strategy, int(gpus.split()[0]))
        assert f": {plan.gib(load['bytes'])} GiB per machine ({load['why']})." in line, line
    assert plan.main(["--model", "codellama-34b", "--gpus", "4", "--json"]) == 0
    loads = json.loads(capsys.readouterr().out)["host_ram_at_load"]
    assert loads["ddp"]["copies"] == 4 and loads["fsdp_full_shard"]["copies"] == 1
    assert loads["ddp"]["bytes"] == 4 * loads["fsdp_full_shard"]["bytes"]


def test_plan_py_recommends_no_config_whose_weights_outgrow_the_host_ram(capsys):
    """TinyLlama LoRA on 4 GPUs: DDP (a replica per process, 8.2 GiB a machine) is the fastest until --host-ram
    leaves it out; below every config's need the answer says what the least needs."""
    sys.path.insert(0, str(REPO / "scripts"))
    import plan

    asked = ["--model", "tinyllama-1.1b", "--gpus", "4", "--gpu", "rtx6000-ada", "--batch-size", "16",
             "--grad-accum", "2", "--seq-len", "1024"]
    assert plan.main(asked) == 0
    [launch_line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Launch: ")]
    assert "accelerate_configs/ddp.yaml --num_processes 4" in launch_line
    assert plan.main([*asked, "--host-ram", "6"]) == 0
    out = capsys.readouterr().out
    [launch_line] = [line for line in out.splitlines() if line.startswith("Launch: ")]
    assert not any(f"accelerate_configs/{name}.yaml" in launch_line for name in ("ddp", "zero1", "zero2")), launch_line
    assert "Not recommended, their weights outgrow --host-ram 6 GiB while they load: ddp (8.20 GiB per machine)" in out
    assert plan.main([*asked, "--host-ram", "1"]) == 0
    out = capsys.readouterr().out
    assert "Every config that fits needs more than 1 GiB of host RAM per machine to load the weights" in out
    assert "Launch: " not in out
