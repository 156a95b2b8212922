"""What trains of a vision-language model: its language model by default, its vision tower (--train-vision-tower)
and projector (--train-projector) when asked, under lora.py, qlora.py and full.py; and what the memory plan counts
of the vision side (recipes/planner/vision.py).

Tiny random Qwen2-VL (its projector, the merger, inside the tower) and LLaVA (a projector beside the tower), built
offline (scripts/build_tiny_model.py --family), on the bundled vision task (data/vision)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import (LLAVA_1_5, REPO, TINY_MODEL, VISION, launch, long_test, merged_beside_adapter,
                      same_curve, vision_rows)

sys.path.insert(0, str(REPO / "recipes"))

import planner  # noqa: E402
from common.launching import args as cli  # noqa: E402
from common.launching import memory_plan, preflight  # noqa: E402
from common.launching.launch import DDP, Launch  # noqa: E402
from common.model import modeling, vision  # noqa: E402
from common.refusal import Refusal  # noqa: E402

FAMILIES = ("qwen2-vl", "llava")
BOTH = [(False, False), (True, False), (False, True), (True, True)]  # (--train-vision-tower, --train-projector)


def flags(tower: bool, projector: bool) -> list[str]:
    return ["--train-vision-tower"] * tower + ["--train-projector"] * projector


def prepared(folder: Path, recipe: str, tower: bool, projector: bool):
    """The model as the recipe prepares it for training: full.py's frozen parts, or LoRA's adapters (QLoRA's on the
    4-bit base, its vision side left in the float dtype)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from common.model.model_config import bits_config, unquantized_modules

    quantized = {}
    if recipe == "qlora":
        quantized = dict(device_map={"": "cpu"}, quantization_config=bits_config(
            4, torch.float32, keep=unquantized_modules(str(folder))))
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, **quantized)
    if recipe == "full":
        modeling.freeze_vision_parts(model, tower, projector)
        return model
    config = LoraConfig(r=8, target_modules=modeling.lora_targets(model, cli.lora_targets("all-linear"), tower),
                        modules_to_save=vision.projector_modules(model) if projector else None, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def parts_of(model) -> dict[str, str]:
    """{parameter name: "tower" / "projector" / "unread" (the tower's, never read) / "language"}: where each
    parameter belongs."""
    inner = model.base_model.model if hasattr(model, "base_model") and hasattr(model.base_model, "model") else model
    parts = {id(param): part for part, params in vision.vision_parameters(inner).items() for param in params}
    return {name: parts.get(id(param), "language") for name, param in model.named_parameters()}


# ---------------------------------------------------------------- what trains under each flag and recipe


@pytest.mark.parametrize("family, recipe, tower, projector", [
    *[(family, "lora", *both) for family in FAMILIES for both in BOTH],
    *[(family, "full", *both) for family in FAMILIES for both in (BOTH[0], BOTH[3])],
    ("qwen2-vl", "qlora", True, True), (LLAVA_1_5, "lora", True, True), (LLAVA_1_5, "full", True, True),
])
def test_what_trains_under_each_flag(family, recipe, tower, projector, vlm):
    """Default: the language model alone. --train-vision-tower: full.py trains every tower weight; LoRA adapts every
    linear layer of the tower (as all-linear picks them in the language model), not the projector's. --train-projector:
    every projector weight (LoRA: peft's trained copy, the loaded one frozen). The planner counts the same."""
    import torch

    model = prepared(vlm(family), recipe, tower, projector)
    where = parts_of(model)
    trained = {name for name, param in model.named_parameters() if param.requires_grad}
    by_part = {part: {name for name in trained if where[name] == part} for part in ("language", "tower", "projector",
                                                                                   "unread")}
    assert by_part["language"] and not by_part["unread"]
    assert bool(by_part["tower"]) == tower and bool(by_part["projector"]) == projector
    if recipe == "full":
        for part, wanted in (("language", True), ("tower", tower), ("projector", projector)):
            everything = {name for name in where if where[name] == part}
            assert by_part[part] == (everything if wanted else set()), part
    else:
        assert all(".lora_" in name for name in by_part["language"] | by_part["tower"])
        assert all(".modules_to_save." in name for name in by_part["projector"])
        if tower:  # an adapter on every linear layer of the tower less its projector's
            inner = model.base_model.model
            name, inside = vision.vision_parts(inner)
            skipped = tuple(f"{module}." for module in inside + vision.unread_modules(inner, name))
            linears = {n.removesuffix(".base_layer") for n, m in inner.named_modules() if type(m) is torch.nn.Linear
                       and n.startswith(f"{name}.") and ".lora_" not in n and not f"{n}.".startswith(skipped)}
            assert linears == {n.removeprefix("base_model.model.").split(".lora_")[0] for n in by_part["tower"]}
    side = memory_plan.vision_shape(SimpleNamespace(model=str(vlm(family)), lora_targets="all-linear", trust_remote_code=False,
                                                      train_vision_tower=tower, train_projector=projector), recipe)
    counted = planner.vision_parameters(side, "full" if recipe == "full" else "lora", 8, tower, projector)
    held = {name: param.numel() for name, param in model.named_parameters() if where[name] != "language"}
    assert counted["trained"] == sum(held[name] for name in trained if name in held)
    assert counted["trained"] + counted["frozen"] == sum(held.values())


@pytest.mark.parametrize("family", [*FAMILIES, LLAVA_1_5])
@pytest.mark.parametrize("recipe", ["full", "lora"])
def test_every_trained_parameter_gets_a_gradient_from_an_image_row(family, recipe, vlm):
    """DDP refuses a step in which a trained parameter got no gradient: with both flags, one image row's backward
    reaches every trained parameter, LLaVA-1.5's layout too (its tower's last block and CLIP's post_layernorm are
    never read, and stay frozen)."""
    from common.data import images
    from common.model import processors

    folder = vlm(family)
    model = prepared(folder, recipe, True, True)
    model.train()
    processor = processors.load(str(folder), modeling.load_tokenizer(str(folder)))
    row = json.loads(vision_rows(Path(folder).parent / "rows.jsonl", 1).read_text())
    text = processor.apply_chat_template(row["messages"], tokenize=False)
    inputs = processor(text=[text], images=[images.load_image(row["images"][0])], add_special_tokens=False,
                       return_tensors="pt")
    model(**inputs, labels=inputs["input_ids"]).loss.backward()
    missed = [name for name, param in model.named_parameters() if param.requires_grad and param.grad is None]
    assert missed == []
    if family == LLAVA_1_5:
        assert {part for part in parts_of(model).values()} >= {"unread"}


def test_families_name_their_parts_from_what_transformers_exposes():
    """The tower from get_encoder(modality="image"), the projector beside it (or inside it: Qwen2-VL's merger), on
    the families the tests do not build: their models from a small config, on the meta device."""
    from transformers import AutoConfig

    from common.model.model_config import empty_model

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512)
    siglip = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=56, patch_size=14)
    configs = {
        "qwen2_5_vl": (dict(text_config=text, vision_config=dict(depth=2, hidden_size=32, out_hidden_size=64,
                                                                 intermediate_size=64, num_heads=2)),
                       ("model.visual", ["model.visual.merger"])),
        "gemma3": (dict(text_config={**text, "model_type": "gemma3_text", "head_dim": 16}, vision_config=siglip,
                        mm_tokens_per_image=4), ("model.vision_tower", ["model.multi_modal_projector"])),
        "idefics3": (dict(text_config={**text, "model_type": "llama"}, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)),
                     ("model.vision_model", ["model.connector"])),
        "mllama": (dict(text_config={**text, "cross_attention_layers": [1], "pad_token_id": 0, "bos_token_id": 1,
                                     "eos_token_id": 2},
                        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_global_layers=1, attention_heads=2, vision_output_dim=64,
                                           intermediate_layers_indices=[0])),
                   ("model.vision_model", ["model.multi_modal_projector"])),
        "paligemma": (dict(text_config={**text, "model_type": "gemma", "head_dim": 16}, vision_config=siglip),
                      ("model.vision_tower", ["model.multi_modal_projector"])),
    }
    for kind, (settings, parts) in configs.items():
        assert vision.vision_parts(empty_model(AutoConfig.for_model(kind, **settings))) == parts, kind


# ---------------------------------------------------------------- refused before the model loads


def refusal(recipe: str, argv: list[str], config_file: Path | None = None) -> str:
    """The line a run of `recipe` with `argv` is refused with, by its flags or by the vision-language check."""
    with pytest.raises(Refusal) as refused:
        run = cli.parse_args(cli.recipe_flags(recipe), argv + (["--config", str(config_file)] if config_file else []))
        preflight.check_vision_language(run, Launch(DDP, 2, False, 0, "no"))
    return str(refused.value)


def test_the_flags_are_refused_where_nothing_can_take_them(vlm, tmp_path):
    qwen = str(vlm("qwen2-vl"))
    assert refusal("lora", ["--model", str(TINY_MODEL), "--train-vision-tower", "--train-projector"]) == (
        f"--train-vision-tower and --train-projector: --model {TINY_MODEL} reads text only (its config names no vision "
        "part); drop them, or give an image-text-to-text model")
    assert refusal("full", ["--model", str(TINY_MODEL), "--train-projector"]).startswith(
        "--train-projector: --model")
    for recipe in ("dpo", "kto", "reward", "grpo", "dpo_full"):
        assert refusal(recipe, ["--model", qwen, "--train-vision-tower"]) == (
            "unrecognized arguments: --train-vision-tower; --train-vision-tower: only recipes/lora.py, qlora.py and "
            "full.py train a vision tower or projector (docs/data.md#images); see --help")
    (tmp_path / "run.yaml").write_text("train-projector: true\n")
    assert refusal("kto", [], tmp_path / "run.yaml") == (
        f"--config {tmp_path / 'run.yaml'}: `train-projector` is not a flag of this recipe; only recipes/lora.py, "
        "qlora.py and full.py train a vision tower or projector (docs/data.md#images)")
    assert refusal("qlora", ["--model", qwen, "--train-vision-tower", "--lora-targets", "q_proj,v_proj"]) == (
        f"--train-vision-tower: --lora-targets q_proj,v_proj names no linear layer of {qwen}'s vision tower, whose "
        "linear layers are fc1, fc2, proj, qkv; add some of them, or use all-linear")
    run = cli.parse_args(cli.recipe_flags("lora"), ["--model", qwen, "--train-vision-tower", "--lora-targets", "qkv"])
    preflight.check_vision_language(run, Launch(DDP, 2, False, 0, "no"))  # a tower layer named: it runs


# ---------------------------------------------------------------- the plan counts the vision side


def saved_by_the_vision_side(model, inputs: dict) -> int:
    """Bytes of the unique storages autograd keeps from the image features' forward, parameters excluded."""
    import torch

    parameters = {param.untyped_storage().data_ptr() for param in model.parameters()}
    kept, held = {}, []

    def pack(tensor):
        held.append(tensor)  # alive until the end: a storage let go of could return at its address as another
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.get_image_features(**inputs)
    return sum(kept.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_towers_activations_are_planned_within_a_fifth_of_what_autograd_keeps(family, vlm):
    """The planner's bytes kept by the tower and projector for the backward (an estimate of a ViT block, not each
    family's exact tensors) against what autograd keeps on two images, float32: within 20% under full fine-tuning,
    LoRA on the tower, and the projector alone; nothing for a frozen tower."""
    from PIL import Image

    from common.model import processors

    folder = vlm(family)
    processor = processors.load(str(folder), modeling.load_tokenizer(str(folder)))
    image = Image.open(VISION / "images" / "train_00001.png").convert("RGB")
    inputs = processor(text=[processor.image_token * 2], images=[[image] * 2], return_tensors="pt")
    inputs = {key: value for key, value in inputs.items() if key in ("pixel_values", "image_grid_thw", "image_sizes")}
    for recipe, tower, projector in (("full", True, True), ("lora", True, True), ("lora", False, True),
                                     ("lora", False, False)):
        model = prepared(folder, recipe, tower, projector)
        model.train()
        inner = model.model if recipe == "full" else model.base_model.model.model
        measured = saved_by_the_vision_side(inner, inputs)
        side = memory_plan.vision_shape(SimpleNamespace(model=str(folder), lora_targets="all-linear",
                                                          trust_remote_code=False, train_vision_tower=tower,
                                                          train_projector=projector), recipe)
        # the positions the tower runs: Qwen2-VL's patches, CLIP's and its class token
        patches = inputs["pixel_values"].shape[0] if family == "qwen2-vl" else 2 * ((56 // 14) ** 2 + 1)
        planned = planner.vision_kept_bytes(side, recipe, "ddp", patches, 8, "fp32", tower, projector)
        if not (tower or projector):
            assert planned == 0 and measured < 4 * 2**10, measured  # (Qwen2-VL keeps its rotary frequencies' product)
        else:
            assert 0.8 <= planned / measured <= 1.25, (recipe, tower, projector, planned, measured)


def test_the_plan_adds_what_trains_of_the_vision_side(vlm):
    """Frozen, the vision side adds its weights and one block's working tensors; trained, its gradients and optimizer
    state too, split as the strategy splits the language model's; and the tower's activations."""
    side = memory_plan.vision_shape(SimpleNamespace(model=str(vlm("qwen2-vl")), lora_targets="all-linear",
                                                      trust_remote_code=False, train_vision_tower=True,
                                                      train_projector=True), "full")
    shape = planner.load_shape(str(vlm("qwen2-vl")))
    plain = planner.per_gpu_bytes(shape, "full", "ddp", 2, 4, 512, precision="fp32")
    frozen = planner.per_gpu_bytes(shape, "full", "ddp", 2, 4, 512, precision="fp32", vision=side)
    trained = planner.per_gpu_bytes(shape, "full", "ddp", 2, 4, 512, precision="fp32", vision=side,
                                    train_vision_tower=True, train_projector=True)
    parameters = side.tower + side.projector
    assert frozen["weights"] - plain["weights"] == 4 * parameters and frozen["gradients"] == plain["gradients"]
    assert trained["gradients"] - plain["gradients"] == 2 * 4 * parameters  # param.grad and DDP's bucket
    assert trained["optimizer"] - plain["optimizer"] == 8 * parameters
    assert trained["activations"] > frozen["activations"] > plain["activations"]
    assert trained["vision"] == trained["total"] - plain["total"]
    sharded = planner.per_gpu_bytes(shape, "full", "zero3", 2, 4, 512, precision="fp32", vision=side,
                                    train_vision_tower=True, train_projector=True)
    state = sharded["vision"] - (sharded["activations"] - planner.per_gpu_bytes(
        shape, "full", "zero3", 2, 4, 512, precision="fp32")["activations"])
    assert state == pytest.approx(20 * parameters / 2, abs=3)  # weight, gradient, master and moments: half a rank


# ---------------------------------------------------------------- a launch: trained, saved, reloaded as trained


def test_lora_trains_the_tower_and_projector_and_the_adapter_reloads_as_trained(vlm, tmp_path):
    """lora.py --train-vision-tower --train-projector under DDP: the plan line counts them; the tower's adapters and
    the projector moved; the adapter loaded on its base (PeftModel.from_pretrained) holds every weight the run's
    last checkpoint holds, and answers differently from the base on an image row."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from common.data import images
    from common.model import processors

    model, data = vlm("qwen2-vl"), vision_rows(tmp_path / "rows.jsonl", 8)
    done = launch("lora", tmp_path / "out", "--model", str(model), "--dataset", str(data), "--eval-dataset", str(data),
                  "--max-steps", "1", "--save-every", "1", "--batch-size", "4", "--lr", "5e-2",
                  *flags(True, True), config="ddp")
    assert done.returncode == 0, done.output[-3000:]
    assert "the vision tower and projector (the tower and projector trained) add" in done.output
    assert done.run_json()["arguments"]["train_vision_tower"] is True
    checkpoint = load_file(str(tmp_path / "out" / "checkpoints" / "step-1" / "model.safetensors"))
    tower = [key for key in checkpoint if ".visual.blocks." in key and ".lora_B." in key]
    assert tower and all(checkpoint[key].abs().sum() > 0 for key in tower)  # B starts at zero
    merger = [key.split(".modules_to_save.default.")[1] for key in checkpoint if ".merger.modules_to_save." in key]
    assert merger and all(not torch.equal(checkpoint[f"base_model.model.model.visual.merger.modules_to_save.default.{key}"],
                                          checkpoint[f"base_model.model.model.visual.merger.original_module.{key}"])
                          for key in merger)
    base = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "out" / "adapter").eval()
    state = reloaded.state_dict()
    assert set(checkpoint) <= set(state)
    assert all(torch.equal(state[key], tensor) for key, tensor in checkpoint.items())
    processor = processors.load(str(model), modeling.load_tokenizer(str(model)))
    row = json.loads(data.read_text().splitlines()[0])
    text = processor.apply_chat_template(row["messages"], tokenize=False)
    inputs = processor(text=[text], images=[images.load_image(row["images"][0])], add_special_tokens=False,
                       return_tensors="pt")
    untrained = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad(), reloaded.disable_adapter():
        torch.testing.assert_close(reloaded(**inputs).logits, untrained(**inputs).logits)
    with torch.no_grad():
        assert not torch.allclose(reloaded(**inputs).logits, untrained(**inputs).logits, atol=1e-4)


# ---------------------------------------------------------------- long: every strategy, the exports, a resume


STEPS = ["--max-steps", "3", "--grad-accum", "2", "--lr", "5e-3"]
NO_DROPOUT = {"lora": ["--lora-dropout", "0"], "qlora": ["--lora-dropout", "0"], "full": []}  # each rank its own masks


@pytest.fixture(scope="module")
def one_process(vlm, tmp_path_factory):
    """(family, recipe) -> (the one-process run with both flags, its rows): 3 steps of 16 rows (8 x 2 micro-batches),
    every step the whole dataset, a checkpoint at the end."""
    runs = {}

    def run(family: str, recipe: str):
        if (family, recipe) not in runs:
            folder = tmp_path_factory.mktemp(f"one-{family}-{recipe}")
            data = vision_rows(folder / "rows.jsonl", 16)
            done = launch(recipe, folder / "out", "--model", str(vlm(family)), "--dataset", str(data),
                          "--eval-dataset", str(data), *STEPS, *NO_DROPOUT[recipe], "--batch-size", "8",
                          "--save-every", "3", *flags(True, True), processes=1)
            assert done.returncode == 0, done.output[-3000:]
            runs[family, recipe] = (done, data)
        return runs[family, recipe]

    return run





@long_test
@pytest.mark.parametrize("family, recipe, config", [
    ("qwen2-vl", "lora", "zero3"), ("qwen2-vl", "lora", "fsdp"), ("qwen2-vl", "full", "fsdp"),
    ("qwen2-vl", "full", "zero3"), ("qwen2-vl", "qlora", "ddp"), (LLAVA_1_5, "full", "ddp"), (LLAVA_1_5, "lora", "ddp"),
])
def test_every_strategy_trains_the_vision_side_as_one_process_does(family, recipe, config, one_process, vlm, tmp_path):
    """Both flags, 2 processes x 4 rows x 2 micro-batches: the one-process loss and gradient norm, step by step (DDP
    on LLaVA-1.5's layout: no trained parameter left without a gradient)."""
    single, data = one_process(family, recipe)
    done = launch(recipe, tmp_path / "out", "--model", str(vlm(family)), "--dataset", str(data), "--eval-dataset",
                  str(data), *STEPS, *NO_DROPOUT[recipe], "--batch-size", "4", *flags(True, True), config=config)
    assert done.returncode == 0, done.output[-3000:]
    assert done.run_json()["num_processes"] == 2
    same_curve(done.metrics(), single.metrics())


@long_test
def test_full_fine_tuning_exports_the_trained_vision_side(one_process, vlm):
    """full.py with both flags: model/ loads with AutoModelForImageTextToText holding every weight of the run's last
    checkpoint, its tower and projector moved from the base's."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    done, _ = one_process("qwen2-vl", "full")
    checkpoint = load_file(str(done.output_dir / "checkpoints" / "step-3" / "model.safetensors"))
    exported = AutoModelForImageTextToText.from_pretrained(done.output_dir / "model", dtype=torch.float32).state_dict()
    base = AutoModelForImageTextToText.from_pretrained(vlm("qwen2-vl"), dtype=torch.float32).state_dict()
    assert all(torch.equal(exported[key], tensor) for key, tensor in checkpoint.items())
    for part in (".visual.blocks.", ".visual.merger."):
        moved = [key for key in checkpoint if part in key and not torch.equal(checkpoint[key], base[key])]
        assert moved, part


@long_test  # ~30 s: a launch and three loads
def test_merged_model_carries_the_trained_vision_side(vlm, tmp_path):
    """lora.py --merge with both flags on LLaVA under DDP: merged/ answers on an image row as the adapter on its base,
    and its vision tower and projector are no longer the base's."""
    import torch
    from transformers import AutoModelForImageTextToText

    model, data = vlm("llava"), vision_rows(tmp_path / "rows.jsonl", 16)
    done = launch("lora", tmp_path / "out", "--model", str(model), "--dataset", str(data), "--max-steps", "2",
                  "--batch-size", "4", "--lr", "5e-2", "--merge", *flags(True, True), config="ddp")
    assert done.returncode == 0, done.output[-3000:]
    merged, adapted, inputs = merged_beside_adapter(model, tmp_path / "out", data)
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, adapted(**inputs).logits, atol=1e-5, rtol=1e-5)
    before = dict(AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).named_parameters())
    for part in ("vision_tower.encoder.", "multi_modal_projector."):
        moved = [name for name, tensor in merged.named_parameters() if part in name
                 and not torch.equal(tensor, before[name])]
        assert moved, part


@long_test  # ~50 s: two launches
def test_a_checkpoint_with_the_vision_side_trained_continues_under_another_strategy(vlm, tmp_path):
    """Both flags: 4 steps under DDP, a checkpoint at step 2; continued from it under ZeRO-3, steps 3 and 4 are the
    uninterrupted run's (the tower's adapters, the projector and their optimizer states restored)."""
    import shutil

    model, data = str(vlm("qwen2-vl")), vision_rows(tmp_path / "rows.jsonl", 64)
    run = ["--model", model, "--dataset", str(data), "--max-steps", "4", "--save-every", "2", "--batch-size", "4",
           "--grad-accum", "2", "--lr", "5e-3", "--lora-dropout", "0", *flags(True, True)]
    whole = launch("lora", tmp_path / "whole", *run, config="ddp")
    assert whole.returncode == 0, whole.output[-3000:]
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step-2", tmp_path / "resumed" / "checkpoints" / "step-2")
    resumed = launch("lora", tmp_path / "resumed", *run, "--resume", "auto", config="zero3")
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [m["step"] for m in resumed.metrics()] == [3, 4]
    for mine, uninterrupted in zip(resumed.metrics(), whole.metrics()[2:]):
        assert mine["loss"] == pytest.approx(uninterrupted["loss"], abs=1e-5), (mine, uninterrupted)
        assert mine["grad_norm"] == pytest.approx(uninterrupted["grad_norm"], abs=1e-5), (mine, uninterrupted)
