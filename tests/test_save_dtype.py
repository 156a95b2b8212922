"""--save-dtype: model/ (full.py) and merged/ (--merge) exported in the dtype asked for, config.json saying
so, and loadable; asked of a run that writes neither, it is one line before the model loads."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from conftest import launch, long_test


def float_dtypes(folder) -> set:
    return {tensor.dtype for tensor in load_file(str(folder / "model.safetensors")).values() if tensor.is_floating_point()}


def test_full_exports_its_model_in_the_dtype_asked_for(tmp_path):
    from transformers import AutoModelForCausalLM

    run = launch("full", tmp_path / "out", "--max-steps", "2", "--batch-size", "4", "--save-dtype", "bf16", processes=1)
    assert run.returncode == 0, run.output[-3000:]
    model_dir = run.output_dir / "model"
    assert float_dtypes(model_dir) == {torch.bfloat16}  # trained in fp32 on this CPU
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").dtype == torch.bfloat16


@long_test
def test_merged_is_exported_in_the_dtype_asked_for_and_computes_what_was_trained(tmp_path):
    from transformers import AutoModelForCausalLM

    run = launch("lora", tmp_path / "out", "--max-steps", "2", "--batch-size", "4", "--lr", "5e-3", "--merge",
                 "--save-dtype", "fp16", config="ddp")
    assert run.returncode == 0, run.output[-3000:]
    merged = run.output_dir / "merged"
    assert float_dtypes(merged) == {torch.float16}
    probe = load_file(str(run.output_dir / "probe_logits.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()  # fp16 weights, fp32 compute
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    mask = probe["attention_mask"].bool()
    assert (logits - probe["logits"])[mask].abs().max() <= 0.05  # fp16 rounding of the weights only


def test_a_save_dtype_for_nothing_exported_is_refused_in_one_line(tmp_path):
    run = launch("lora", tmp_path / "out", "--max-steps", "2", "--save-dtype", "bf16", processes=1)
    errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert run.returncode != 0 and len(errors) == 1, run.output[-3000:]
    assert errors[0].startswith("error: --save-dtype bf16 sets the dtype of merged/") and "add --merge" in errors[0]
    assert "model: loading the weights" not in run.output
