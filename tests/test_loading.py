"""One copy of the weights in host RAM under fsdp.yaml (fsdp_cpu_ram_efficient_loading): each process reads its
shards from the model's files once accelerator.prepare has sharded the model built with unread weights; where the
files do not allow it (a checkpoint transformers converts while loading), the main process alone reads them and
accelerate sends each process its shards. Under zero3.yaml (zero3_init_flag) the main process reads them and
DeepSpeed hands each process its partitions from them. Either way the run is the one where every process reads
the whole model: the same losses and the same trained logits, exactly."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from conftest import CONFIGS, launch, long_test
from test_other_architectures import build

ARGS = ("--max-steps", "3", "--batch-size", "2", "--eval-every", "3", "--log-every", "1")
READS_SHARDS = "each process reads its shards"
MAIN_PROCESS_SENDS = "the main process reads and sends the shards"
EVERY_PROCESS_READS = "every process reads the whole model"


def every_rank_reads(tmp_path, config: str = "fsdp") -> str:
    """`config` with fsdp_cpu_ram_efficient_loading (zero3_init_flag) off: each process reads the whole model."""
    text = (CONFIGS / f"{config}.yaml").read_text()
    if "zero3_init_flag: true" in text:
        text = text.replace("zero3_init_flag: true", "zero3_init_flag: false")
    elif "fsdp_cpu_ram_efficient_loading: true" in text:
        text = text.replace("fsdp_cpu_ram_efficient_loading: true", "fsdp_cpu_ram_efficient_loading: false")
    else:  # accelerate's launcher turns it on where a file leaves it out
        text = text.replace("fsdp_config:\n", "fsdp_config:\n  fsdp_cpu_ram_efficient_loading: false\n")
    path = tmp_path / f"{config}_every_rank.yaml"
    path.write_text(text)
    return str(path)


def same_run(one, other) -> None:
    assert one.losses() == other.losses() and one.losses()  # exactly: the same weights reached every shard
    evaluated = [[(record["eval_loss"], record["eval_exact_match"]) for record in run.metrics("eval")] for run in (one, other)]
    assert evaluated[0] == evaluated[1] and evaluated[0]
    probes = [load_file(str(run.output_dir / "probe_logits.safetensors"))["logits"] for run in (one, other)]
    assert probes[0].equal(probes[1])


@pytest.mark.parametrize("recipe, model, config, expected", [
    ("lora", None, "fsdp", READS_SHARDS),
    # its LM head is its embedding: the tie survives the unread build (every run trains gpt2 under fsdp.yaml in
    # tests/test_other_architectures.py; this compares its weights with a plain load)
    pytest.param("lora", "gpt2", "fsdp", READS_SHARDS, marks=long_test),
    pytest.param("lora", "mixtral", "fsdp", MAIN_PROCESS_SENDS, marks=long_test),  # experts apart in its files
    pytest.param("lora", None, "fsdp_grad_op", READS_SHARDS, marks=long_test),  # fsdp's loading, every run
    pytest.param("full", None, "fsdp_offload", READS_SHARDS, marks=long_test),
    pytest.param("lora", None, "zero3", MAIN_PROCESS_SENDS, marks=long_test),  # partitions from the main process
    pytest.param("lora", "gpt2", "zero3", MAIN_PROCESS_SENDS, marks=long_test),
    pytest.param("full", None, "zero3_offload", MAIN_PROCESS_SENDS, marks=long_test),
])
def test_the_shards_are_read_once_a_machine_and_the_run_is_the_same(recipe, model, config, expected, tmp_path):
    extra = ()
    if model:
        build(model, tmp_path / model)
        extra = ("--model", str(tmp_path / model))
    once = launch(recipe, tmp_path / "once", *ARGS, *extra, config=config)
    assert once.returncode == 0, once.output[-3000:]
    every = launch(recipe, tmp_path / "every", *ARGS, *extra, config=every_rank_reads(tmp_path, config))
    assert every.returncode == 0, every.output[-3000:]
    assert once.run_json()["launch"]["loading"] == expected
    assert every.run_json()["launch"]["loading"] == EVERY_PROCESS_READS
    said = "loading: the main process reads the weights and sends each process its shards, since its files name"
    assert (said in once.output) == (expected == MAIN_PROCESS_SENDS and config.startswith("fsdp"))
    same_run(once, every)


def test_the_files_decide_whether_each_process_can_read_its_shards(tmp_path):
    """Checked before the model loads, on every rank alike, from the files' names and the config alone."""
    import json
    import shutil

    from common.model.shard_loading import why_not_read_shards

    for kind in ("gpt2", "mixtral"):
        build(kind, tmp_path / kind)
    assert why_not_read_shards(str(tmp_path / "gpt2"), False) is None  # tied: the head is read as the embedding
    assert why_not_read_shards(str(tmp_path / "mixtral"), False) == (
        "its files name the weights otherwise than the model (no model.layers.0.mlp.gate.weight)")  # its router, under another name
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(tmp_path / "gpt2" / "config.json", config_only)
    assert why_not_read_shards(str(config_only), False) == "it has no safetensors files"
    quantized = tmp_path / "quantized"
    shutil.copytree(tmp_path / "gpt2", quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (quantized / "config.json").write_text(json.dumps(config))
    assert why_not_read_shards(str(quantized), False) == "its weights are stored quantized"


def test_a_weight_the_prepared_model_renamed_is_refused_not_left_unread():
    """A wrapper the name mapping does not know (a user's edit of the recipe) hides the weights from the files:
    one line naming the switch, not a run on unread memory."""
    import torch

    from common.model.model_config import DEFAULT_MODEL
    from common.model.shard_loading import read_shards
    from common.refusal import Refusal
    from transformers import AutoModelForCausalLM

    wrapped = torch.nn.ModuleDict({"edited": AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL)})
    with pytest.raises(Refusal) as refused:
        read_shards(wrapped, str(DEFAULT_MODEL), False)
    assert "has no weight named model.embed_tokens.weight" in str(refused.value)
    assert "fsdp_cpu_ram_efficient_loading: false" in str(refused.value)
