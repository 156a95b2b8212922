"""Every recipe under every config the GPUs present can run, in bf16, on a model of
TinyLlama-1.1B's shape cut to 2 layers: the loss goes down, run.json says what ran, and what was
saved reloads in plain transformers / peft to the trained model's logits.

On one GPU the multi-process configs run with one process (FSDP and ZeRO still shard, over one
rank); fsdp_hybrid, sequence parallel (sp.yaml) and a real model-parallel split need two GPUs or more and are
skipped otherwise.
Runs where CUDA is available (scripts/measure/gpu_check.py); skipped elsewhere, with the reason.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_support import GPUS, HAS_GPU, ON_CPU, PRECISION, gpu_launch, gpu_suite, shaped_model  # noqa: E402

pytestmark = gpu_suite

RECIPES = ("full", "lora", "qlora")
# config -> (launch kind run.json must record, GPUs it needs)
CONFIGS = {
    "model_parallel": ("model_parallel" if GPUS > 1 else "single", 1),
    "ddp": ("ddp" if GPUS > 1 else "single", 1),
    "fsdp": ("fsdp", 1), "fsdp_grad_op": ("fsdp", 1), "fsdp_offload": ("fsdp", 1),
    "fsdp_hybrid": ("fsdp", 4),
    "zero1": ("deepspeed", 1), "zero2": ("deepspeed", 1), "zero3": ("deepspeed", 1), "zero3_offload": ("deepspeed", 1),
    "tp": ("tensor_parallel", 4), "fsdp_tp": ("tensor_parallel", 4),  # the files' meshes: 4-way; 2 x 2
    "sp": ("deepspeed", 2),  # a group of 2 splits each row: one GPU cannot hold a group
}
# What the recipes refuse under tensor parallel (tests/test_preflight.py), and LoRA's column-split targets there.
REFUSED = {("qlora", "tp"), ("qlora", "fsdp_tp"), ("lora", "fsdp_tp")}
EXTRA = {("lora", "tp"): ["--lora-targets", "q_proj,k_proj,v_proj,gate_proj,up_proj"]}
STEPS = 8
# bf16 forward of the trained model against the reloaded one: the largest logit difference allowed.
# Chosen before any GPU run; each case records the difference it measured (junit property).
# (The CPU stand-in's model is stored in bf16, like merge/'s output: 1e-2 there.)
BF16_LOGIT_TOLERANCE = 0.25 if HAS_GPU else 1e-2


def cases():
    for recipe in RECIPES:
        for config, (_, needs) in CONFIGS.items():
            marks = [pytest.mark.skipif(max(GPUS, 1) < needs, reason=f"{config} needs {needs} GPUs")]
            if ON_CPU and config == "fsdp_hybrid":
                marks.append(pytest.mark.skip(reason="hybrid shard needs GPUs"))
            if (recipe, config) in REFUSED:
                marks.append(pytest.mark.skip(reason=f"{recipe}.py refuses {config} in one line"))
            yield pytest.param(recipe, config, marks=marks, id=f"{recipe}-{config}")


def reload_logits(recipe: str, output_dir: Path, base: Path, probe: dict) -> dict:
    """The logits of each saved artifact, loaded the way a user would, on the device of the run."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    device = "cuda" if HAS_GPU else "cpu"
    dtype = torch.bfloat16 if HAS_GPU else torch.float32

    def logits(model):
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=HAS_GPU):
            return model.eval()(input_ids=probe["input_ids"].to(device),
                                attention_mask=probe["attention_mask"].to(device)).logits.float().cpu()

    if recipe == "full":  # trained in fp32 under bf16 autocast, as reloaded here
        model = AutoModelForCausalLM.from_pretrained(output_dir / "model", dtype=torch.float32)
        return {"model": logits(model.to(device))}
    if recipe == "qlora":
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=dtype)
        model = AutoModelForCausalLM.from_pretrained(base, quantization_config=quantization, device_map={"": device},
                                                     dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).to(device)
    found = {"adapter": logits(PeftModel.from_pretrained(model, output_dir / "adapter"))}
    if (output_dir / "merged").exists():
        found["merged"] = logits(AutoModelForCausalLM.from_pretrained(output_dir / "merged", dtype=dtype).to(device))
    return found


def check_what_ran(run, config: str, record_property) -> None:
    """run.json names the config's launch, the suite's precision and this machine's device; each rank's host RAM."""
    ran = run.run_json()
    assert ran["launch"]["kind"] == CONFIGS[config][0]
    assert ran["strategy"]["precision"] == ("bf16" if PRECISION == "bf16" else "no")
    assert ran["device"] == ("cuda" if HAS_GPU else "cpu")
    record_property("host_peak_gib_by_rank", json.dumps(ran["host_peak_gib_by_rank"]))


def check_reloads(recipe: str, run, base: Path, record_property) -> None:
    """Each saved artifact of a `recipe` ("full", "lora", "qlora") run, reloaded, gives the trained logits."""
    probe = load_file(str(run.output_dir / "probe_logits.safetensors"))
    mask = probe["attention_mask"].bool()
    for artifact, logits in reload_logits(recipe, run.output_dir, base, probe).items():
        difference = (logits - probe["logits"].float())[mask].abs().max().item()
        record_property(f"{artifact}_max_logit_difference", round(difference, 5))
        assert difference <= BF16_LOGIT_TOLERANCE, f"{artifact}: max logit difference {difference}"


@pytest.mark.parametrize("recipe, config", cases())
def test_recipe_on_gpu(recipe, config, tmp_path, record_property):
    base = shaped_model()
    merge = ["--merge"] if recipe != "full" and config == "ddp" else []
    lr = "1e-4" if recipe == "full" else "2e-3"
    run = gpu_launch(recipe, tmp_path / "out", "--max-steps", str(STEPS), "--batch-size", "4", "--lr", lr,
                     "--max-length", "256", *merge, *EXTRA.get((recipe, config), []), config=config, model=base)
    assert run.returncode == 0, run.output[-4000:]
    record_property("launch_seconds", round(run.seconds, 1))

    check_what_ran(run, config, record_property)

    losses = run.losses()
    assert len(losses) == STEPS and sum(losses[-2:]) < sum(losses[:2]), losses
    record_property("losses", json.dumps([round(x, 4) for x in losses]))
    peaks = [r.get("peak_allocated_gib") for r in run.metrics()]
    if HAS_GPU:
        record_property("peak_allocated_gib", max(peaks))

    check_reloads(recipe, run, base, record_property)
