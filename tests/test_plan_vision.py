"""scripts/plan.py on a vision-language model: its vision tower and projector (frozen or trained), the tower's
activations on a row's image tokens and the host RAM at load, planned as the recipes' start-up `plan:` line plans
them (one code path: memory_plan.vision_shape and planner.vision_bytes), from the model's config alone.

Tiny random Qwen2-VL (scripts/build_tiny_model.py --family qwen2-vl: its projector, the merger, inside the tower),
and Qwen2-VL-72B's config with no weights."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "scripts"))
import plan as plan_cli  # noqa: E402  (scripts/plan.py)
import planner  # noqa: E402
from common.launching import memory_plan  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.launching.launch import DDP, Launch  # noqa: E402

SEQ_LEN, BATCH = 64, 2


def answer(capsys, *argv: str) -> dict:
    """plan.py --json's answer, run in this process."""
    assert plan_cli.main(["--json", "--gpus", "2", "--batch-size", str(BATCH), "--seq-len", str(SEQ_LEN),
                          "--gradient-checkpointing", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def per_gpu(plan: dict, strategy: str = "ddp") -> dict:
    return next(entry["per_gpu_bytes"] for entry in plan["strategies"] if entry["strategy"] == strategy)


def vision_parts(folder) -> dict:
    """{"tower", "projector"}: the parameters of Qwen2-VL's vision side as transformers builds them (no planner), the
    merger apart, and the LoRA parameters at rank 16 of every linear layer of the tower less the merger."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForImageTextToText

    with init_empty_weights():
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(folder))
    named = dict(model.named_parameters())
    tower = sum(p.numel() for n, p in named.items() if n.startswith("model.visual.") and ".merger." not in n)
    projector = sum(p.numel() for n, p in named.items() if n.startswith("model.visual.merger."))
    adapters = sum(16 * (m.in_features + m.out_features) for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and n.startswith("model.visual.") and ".merger." not in n)
    return {"tower": tower, "projector": projector, "adapters": adapters}


@pytest.fixture(scope="module")
def qwen2_vl(vlm, tmp_path_factory):
    """(the tiny Qwen2-VL's folder, its config less its vision part as a text model's, its vision side's counts)."""
    folder = vlm("qwen2-vl")
    config = json.loads((folder / "config.json").read_text())
    text = tmp_path_factory.mktemp("text") / "config.json"
    text.write_text(json.dumps({key: value for key, value in config.items() if key != "vision_config"}))
    return folder, text, vision_parts(folder)


def test_the_plan_of_a_vision_language_model_adds_its_vision_side_to_the_text_plan(qwen2_vl, capsys):
    folder, text, parts = qwen2_vl
    vision, alone = answer(capsys, "--model", str(folder)), answer(capsys, "--model", str(text))
    held = parts["tower"] + parts["projector"]
    assert vision["vision"]["tower"] + vision["vision"]["projector"] == held
    # the recipes train a vision-language model under DDP, ZeRO, FSDP and model parallel only
    assert {e["strategy"] for e in vision["strategies"]} == {
        e["strategy"] for e in alone["strategies"]} & set(planner.VISION_STRATEGIES)
    with_images, without = per_gpu(vision), per_gpu(alone)
    assert with_images["weights"] - without["weights"] == 2 * held  # frozen, bf16, on every DDP rank
    assert (with_images["gradients"], with_images["optimizer"]) == (without["gradients"], without["optimizer"])
    assert with_images["activations"] > without["activations"]
    assert with_images["total"] - without["total"] == with_images["vision"]
    # two DDP processes on a machine each load a replica, the vision side with it (bf16)
    assert vision["host_ram_at_load"]["ddp"]["bytes"] - alone["host_ram_at_load"]["ddp"]["bytes"] == 2 * 2 * held
    # a frozen tower's activations: one block's working tensors a patch, linear in the image tokens of a row
    fewer = per_gpu(answer(capsys, "--model", str(folder), "--image-tokens", str(SEQ_LEN // 4)))
    assert (with_images["activations"] - without["activations"]) == 4 * (fewer["activations"] - without["activations"])


@pytest.mark.parametrize("method, flag", [("lora", "--train-vision-tower"), ("lora", "--train-projector"),
                                          ("full", "--train-vision-tower")])
def test_training_the_tower_or_the_projector_adds_the_optimizer_state_of_what_trains(qwen2_vl, capsys, method, flag):
    folder, _, parts = qwen2_vl
    frozen = per_gpu(answer(capsys, "--model", str(folder), "--method", method))
    plan = answer(capsys, "--model", str(folder), "--method", method, flag)
    trained = {("lora", "--train-vision-tower"): parts["adapters"], ("lora", "--train-projector"): parts["projector"],
               ("full", "--train-vision-tower"): parts["tower"]}[method, flag]
    assert plan["vision"]["trained"] == trained
    usage = per_gpu(plan)
    assert usage["optimizer"] - frozen["optimizer"] == 8 * trained  # AdamW's two fp32 moments
    assert usage["gradients"] - frozen["gradients"] == 2 * 4 * trained  # param.grad and DDP's bucket, fp32
    assert usage["activations"] > frozen["activations"]
    if (method, flag) == ("lora", "--train-projector"):  # peft trains a fp32 copy; the loaded projector stays
        assert usage["weights"] - frozen["weights"] == 4 * trained
    launch_line = plan["recommendation"]["fastest"]["launch"]
    assert flag in launch_line  # the Launch line runs what was planned


def test_plan_py_and_the_start_up_line_plan_the_same(qwen2_vl, capsys, monkeypatch):
    """The recipes' start-up line and plan.py, the same model, flags and batch on 2 DDP processes: the same bytes in
    each part, the same host RAM at load."""
    folder, _, _ = qwen2_vl
    flags = ["--train-vision-tower", "--train-projector"]
    plan = answer(capsys, "--model", str(folder), *flags)
    args = parse_args(recipe_flags("lora"), ["--model", str(folder), "--batch-size", str(BATCH), "--max-length",
                                             str(SEQ_LEN), "--gradient-checkpointing", *flags])
    launch = Launch(DDP, processes=2, on_gpu=False, visible_gpus=0, precision="bf16")
    shape, inputs = memory_plan.planner_inputs(args, "lora", launch)
    assert inputs["vision"].tower > 0
    need = planner.per_gpu_bytes(shape, "lora", "ddp", 2, batch_size=BATCH, **inputs)
    assert need == per_gpu(plan)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    memory_plan.announce_plan(args, "lora", launch)
    line = capsys.readouterr().out
    assert f"host RAM to load the weights: {memory_plan.size(plan['host_ram_at_load']['ddp']['bytes'])}" in line
    assert f"{memory_plan.size(need['total'])} per process" in line and f"add {memory_plan.size(need['vision'])}" in line


def test_vision_flags_on_a_text_model_and_too_many_image_tokens_are_one_line(qwen2_vl, capsys):
    _, text, _ = qwen2_vl
    assert plan_cli.main(["--model", str(text), "--train-projector"]) == 2
    refusal = capsys.readouterr().err.strip()
    assert refusal.startswith("plan.py: --train-projector: --model") and "reads text only" in refusal
    assert "\n" not in refusal
    with pytest.raises(SystemExit):
        plan_cli.parse_args(["--seq-len", "64", "--image-tokens", "65"])
    assert "--image-tokens 65 is more than a row holds" in capsys.readouterr().err


QWEN2_VL_72B = {  # Qwen/Qwen2-VL-72B-Instruct's config.json, the fields that size it
    "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 8192,
    "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "vocab_size": 152064, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 8192, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}}


def test_a_72b_vision_language_model_plans_from_its_config_json_alone(tmp_path, capsys, monkeypatch):
    """No weights, no hub: the vision side counted on the model built on the meta device, its weights in the host
    RAM at load."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN2_VL_72B))
    plan = answer(capsys, "--model", str(config), "--gpus", "8", "--seq-len", "2048", "--image-tokens", "1024")
    side = plan["vision"]
    assert 0.6e9 < side["tower"] < 0.7e9 and side["projector"] > 0 and side["image_tokens"] == 1024
    shape = planner.load_shape(str(config))
    assert 72e9 < shape.parameters < 73e9  # the language model's
    load = plan["host_ram_at_load"]["fsdp_full_shard"]  # one bf16 copy a machine, the vision side in it
    assert load["bytes"] == 2 * (shape.parameters + side["tower"] + side["projector"])
    assert {e["strategy"] for e in plan["strategies"]} <= set(planner.VISION_STRATEGIES)


def test_a_config_whose_top_level_sizes_are_not_its_decoders_plans_its_text_part():
    """PaliGemma's config has a top-level hidden_size (its projector's) and no heads or layers there: the plan
    reads the decoder from text_config, as it does for a config with no top-level sizes at all."""
    text = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 192, "vocab_size": 1472, "head_dim": 16}
    shape = planner.ModelShape.from_config({"hidden_size": 2048, "text_config": text, "vision_config": {}})
    assert (shape.hidden, shape.layers, shape.heads, shape.reads_images) == (64, 2, 4, True)
