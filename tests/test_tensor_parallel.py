"""Tensor parallel (tp.yaml) over 2 processes and FSDP x TP (fsdp_tp.yaml) over 2 x 2 = 4 processes,
through the real `accelerate launch` on CPU, against the one-process launch of the matrix
(tests/strategies.py: same seed, same global batch of 16, 8 steps, a checkpoint every 4).

Each launch must give the one-process loss curve (fp32, 1e-5 relative), record its mesh and what
each rank holds in run.json (equal to the planner's `resident_bytes`, byte for byte), export a
model that plain transformers reloads to the trained logits, and resume exactly.
"""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, TINY_MODEL, launch, long_test
from strategies import SAVE_EVERY, STEPS, matrix_args
from test_equivalence import max_relative_difference

sys.path.insert(0, str(REPO / "recipes"))
import planner  # noqa: E402

# The shipped files are written for 4 GPUs (tp: 4-way); on 2 CPU processes the mesh is given to the launcher.
MESHES = {
    "tp": (2, ("--parallelism_config_tp_size", "2")),
    "fsdp_tp": (4, ("--parallelism_config_tp_size", "2", "--parallelism_config_dp_shard_size", "2")),
}
DATA_PARALLEL = {"tp": 1, "fsdp_tp": 2}  # ranks with their own micro-batches: the batch splits over these only
SHAPE = planner.load_shape("tiny-llama")
COLUMN_SPLIT = "q_proj,k_proj,v_proj,gate_proj,up_proj"  # what peft can adapt under tensor parallel


def tp_launch(recipe: str, config: str, output_dir, *extra: str):
    """The matrix launch's arguments for as many data-parallel ranks as the mesh has."""
    processes, mesh = MESHES[config]
    args = matrix_args(recipe, "ddp" if DATA_PARALLEL[config] == 2 else "model_parallel")
    return launch(recipe, output_dir, *args, *extra, config=config, processes=processes, launcher_args=mesh,
                  timeout=900)


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    runs = {}

    def run(recipe: str, config: str):
        if (recipe, config) not in runs:
            extra = ("--lora-targets", COLUMN_SPLIT) if recipe == "lora" else ()
            runs[recipe, config] = tp_launch(recipe, config, tmp_path_factory.mktemp(f"{recipe}-{config}") / "out",
                                             *extra)
        return runs[recipe, config]

    return run


def reloaded_logits(output_dir, recipe: str):
    from transformers import AutoModelForCausalLM

    probe = load_file(str(output_dir / "probe_logits.safetensors"))
    if recipe == "full":
        model = AutoModelForCausalLM.from_pretrained(output_dir / "model")
    else:
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY_MODEL), output_dir / "adapter")
    with torch.no_grad():
        logits = model.eval()(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    return logits, probe["logits"]


@pytest.mark.parametrize("config", ["tp", pytest.param("fsdp_tp", marks=long_test)])  # fsdp_tp: 4 processes, ~37 s
def test_full_fine_tuning_splits_the_layers_and_matches_one_process(config, tp_runs, trained, record_property):
    run = tp_runs("full", config)
    assert run.returncode == 0, run.output[-4000:]
    record_property("launch_seconds", round(run.seconds, 1))  # into --junitxml, for README's table
    reference = trained("full", "model_parallel")
    difference = max_relative_difference(reference.losses(), run.losses())
    record_property("max_relative_difference", difference)
    assert difference <= 1e-5, (reference.losses(), run.losses())

    processes, _ = MESHES[config]
    ran = run.run_json()
    assert ran["launch"]["kind"] == "tensor_parallel" and ran["launch"]["tensor_parallel"] == 2
    assert ran["batch"]["global_batch_size"] == 16
    mesh = ran["strategy"]["tensor_parallel"]["mesh"]
    assert mesh == ({"tp": 2} if config == "tp" else {"dp_shard": 2, "tp": 2})
    assert ran["strategy"]["tensor_parallel"]["whole_parameters"] == (5 if config == "tp" else 0)  # the norms
    # Each rank holds its part, as the planner says, to the byte.
    planned = planner.resident_bytes(SHAPE, "full", config, processes, precision="fp32")
    assert ran["memory_by_rank"] == [planned] * processes
    held = ran["parameters"]["held_by_rank"]
    assert len(held) == processes and max(held) < 0.6 * ran["parameters"]["total"] * 2 / processes

    logits, trained_logits = reloaded_logits(run.output_dir, "full")
    assert torch.allclose(logits, trained_logits, atol=1e-4), (logits - trained_logits).abs().max()


@long_test  # two launches (~35 s); full fine-tuning under tp runs in every run
def test_lora_splits_its_adapters_with_the_layers(tp_runs, tmp_path, record_property):
    run = tp_runs("lora", "tp")
    assert run.returncode == 0, run.output[-4000:]
    record_property("launch_seconds", round(run.seconds, 1))
    one = launch("lora", tmp_path / "one", *matrix_args("lora", "model_parallel"), "--lora-targets", COLUMN_SPLIT,
                 config=None)
    assert one.returncode == 0, one.output[-3000:]
    difference = max_relative_difference(one.losses(), run.losses())
    record_property("max_relative_difference", difference)
    assert difference <= 1e-5, (one.losses(), run.losses())
    ran = run.run_json()
    planned = planner.resident_bytes(SHAPE, "lora", "tp", 2, precision="fp32", lora_rank=ran["arguments"]["lora_r"],
                                     lora_targets=COLUMN_SPLIT)
    assert ran["memory_by_rank"] == [planned] * 2
    logits, trained_logits = reloaded_logits(run.output_dir, "lora")
    assert torch.allclose(logits, trained_logits, atol=1e-4), (logits - trained_logits).abs().max()


# Both go through torch's distributed checkpoint (every run resumes FSDP2 and ZeRO-3 in test_resume.py).
@pytest.mark.parametrize("config", [pytest.param("tp", marks=long_test), pytest.param("fsdp_tp", marks=long_test)])
def test_a_resumed_run_continues_the_same_curve(config, tp_runs, tmp_path):
    whole = tp_runs("full", config)
    assert whole.returncode == 0, whole.output[-3000:]
    checkpoint = f"step-{SAVE_EVERY}"
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(whole.output_dir / "checkpoints" / checkpoint, resumed_dir / "checkpoints" / checkpoint)
    resumed = tp_launch("full", config, resumed_dir, "--resume", "auto")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [r["step"] for r in resumed.metrics()] == list(range(SAVE_EVERY + 1, STEPS + 1))
    assert resumed.losses() == whole.losses()[SAVE_EVERY:]


@long_test
@pytest.mark.parametrize("written, config", [("tp", "fsdp"), ("ddp", "tp"), ("fsdp_tp", "zero3")])
def test_a_checkpoint_crosses_to_and_from_tensor_parallel(written, config, tp_runs, trained, tmp_path):
    """Tensor parallel's split checkpoint continues under FSDP2, DDP's under tensor parallel, FSDP x TP's under
    ZeRO-3 (read by parameter name), on the same curve."""
    whole = tp_runs("full", written) if written in MESHES else trained("full", written)
    assert whole.returncode == 0, whole.output[-3000:]
    checkpoint = f"step-{SAVE_EVERY}"
    shutil.copytree(whole.output_dir / "checkpoints" / checkpoint, tmp_path / "checkpoints" / checkpoint)
    if config in MESHES:
        resumed = tp_launch("full", config, tmp_path, "--resume", "auto")
    else:
        resumed = launch("full", tmp_path, *matrix_args("full", config), "--resume", "auto", config=config)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "its trained state is read parameter by parameter into this launch" in resumed.output
    assert resumed.losses() == pytest.approx(whole.losses()[SAVE_EVERY:], rel=1e-5)
