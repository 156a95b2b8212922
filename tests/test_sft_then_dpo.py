"""The path after LoRA SFT: the adapter folder it saved is the --model of preference tuning (its base with the
adapter merged in, so the reference is the SFT model), the result answers prompts, and scripts/merge.py merges
an adapter saved without --merge any time after."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from conftest import REPO, launch


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """lora.py on the bundled model and data, adapter/ and (--merge) merged/ saved."""
    out = tmp_path_factory.mktemp("sft") / "out"
    run = launch("lora", out, "--max-steps", "6", "--batch-size", "4", "--lr", "5e-3", "--merge")
    assert run.returncode == 0, run.output[-3000:]
    return out


def dpo(model: str, out, cache, processes: int = 2, steps: int = 2):
    run = launch("dpo", out, "--model", model, "--max-steps", str(steps), "--batch-size", "2", "--log-every", "1",
                 config="ddp", processes=processes, env={"RECIPES_CACHE": str(cache)})
    assert run.returncode == 0, run.output[-3000:]
    return run


def test_dpo_from_the_sft_adapter_starts_from_the_sft_model_and_answers(sft, tmp_path):
    cache = tmp_path / "cache"
    from_adapter = dpo(str(sft / "adapter"), tmp_path / "from-adapter", cache)
    assert "is a LoRA adapter; training its base" in from_adapter.output
    from_merged = dpo(str(sft / "merged"), tmp_path / "from-merged", cache)  # what --merge wrote
    from_base = dpo(str(REPO / "models" / "tiny-llama"), tmp_path / "from-base", cache, steps=1)
    # the same model as the SFT run's merged/: the same log-probabilities (policy and reference), step by step
    for mine, merged in zip(from_adapter.metrics(), from_merged.metrics()):
        for key in ("loss", "logps/chosen", "logps/rejected", "rewards/margins"):
            assert mine[key] == pytest.approx(merged[key], rel=1e-5, abs=1e-6), key
    assert from_adapter.metrics()[0]["logps/chosen"] != pytest.approx(from_base.metrics()[0]["logps/chosen"], rel=1e-3)
    settled = from_adapter.run_json()["arguments"]["settled_from"]
    assert "merged onto its base" in settled["model"] and str(sft / "adapter") in settled["model"]
    card = (tmp_path / "from-adapter" / "README.md").read_text()  # the model card says where the model came from
    assert "merged onto its base" in card
    assert ("checkpoints/" in card) == (tmp_path / "from-adapter" / "checkpoints").is_dir()

    again = dpo(str(sft / "adapter"), tmp_path / "again", cache, processes=1, steps=1)  # a second run finds the merge
    assert "merged by an earlier run" in again.output
    answered = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), str(tmp_path / "from-adapter"),
                               "--prompt", "Sort: 3 1 2", "--max-new-tokens", "8"], capture_output=True, text=True)
    assert answered.returncode == 0 and answered.stdout.strip(), answered.stderr[-2000:]


def test_merge_writes_what_the_merge_flag_wrote(sft, tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "merge.py"), str(sft / "adapter"),
                           str(tmp_path / "merged")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    ours, flags = load_file(str(tmp_path / "merged" / "model.safetensors")), load_file(str(sft / "merged" / "model.safetensors"))
    assert ours.keys() == flags.keys() and all((ours[k] == flags[k]).all() for k in ours)
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    refused = subprocess.run([sys.executable, str(REPO / "scripts" / "merge.py"), str(sft / "merged"), str(tmp_path / "x")],
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "is not a LoRA adapter folder" in refused.stderr.strip().splitlines()[-1]
