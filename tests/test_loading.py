"""One copy of the weights in host RAM: under fsdp.yaml (fsdp_cpu_ram_efficient_loading) the main process alone
reads them, the others build the model on the meta device and receive their shards in accelerator.prepare. The
run is the same as when every process reads the weights: the same losses and the same trained logits, exactly."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from conftest import CONFIGS, launch, long_test
from test_other_architectures import build

ARGS = ("--max-steps", "3", "--batch-size", "2", "--eval-every", "3", "--log-every", "1")


def every_rank_reads(tmp_path) -> str:
    """fsdp.yaml with fsdp_cpu_ram_efficient_loading off: each process reads the whole model (the loading before)."""
    text = (CONFIGS / "fsdp.yaml").read_text()
    assert "fsdp_cpu_ram_efficient_loading: true" in text
    path = tmp_path / "fsdp_every_rank.yaml"
    path.write_text(text.replace("fsdp_cpu_ram_efficient_loading: true", "fsdp_cpu_ram_efficient_loading: false"))
    return str(path)


@pytest.mark.parametrize("recipe, model", [("lora", None), ("lora", "gpt2"), pytest.param("full", None, marks=long_test)])
def test_the_main_process_alone_reads_the_weights_and_the_run_is_the_same(recipe, model, tmp_path):
    """The bundled Llama, and GPT-2 (its LM head is its embedding: the tie survives the unread build)."""
    extra = ()
    if model:
        build(model, tmp_path / model)
        extra = ("--model", str(tmp_path / model))
    once = launch(recipe, tmp_path / "once", *ARGS, *extra, config="fsdp")
    assert once.returncode == 0, once.output[-3000:]
    every = launch(recipe, tmp_path / "every", *ARGS, *extra, config=every_rank_reads(tmp_path))
    assert every.returncode == 0, every.output[-3000:]
    assert once.run_json()["launch"]["main_process_loads"] is True
    assert every.run_json()["launch"]["main_process_loads"] is False
    assert once.losses() == every.losses()  # exactly: the same weights reached every shard
    evaluated = [[(record["eval_loss"], record["eval_exact_match"]) for record in run.metrics("eval")] for run in (once, every)]
    assert evaluated[0] == evaluated[1] and evaluated[0]
    probes = [load_file(str(run.output_dir / "probe_logits.safetensors"))["logits"] for run in (once, every)]
    assert probes[0].equal(probes[1])
