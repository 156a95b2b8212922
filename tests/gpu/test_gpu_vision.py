"""A vision-language model's LoRA step on the GPU at a real shape: Qwen2-VL-2B's (its text model and vision tower,
config in code below) with random weights built on the GPU (no download), bf16, rows with a 448 x 448 image each (256
image tokens through the processor), 10 steps of recipes/lora.py through `accelerate launch` (ddp.yaml, one process):
seconds a step, target and input tokens a second, the peak GPU memory allocated and reserved, beside the plan line the
launch printed (its figure, and what it says it leaves out). The processor is the tiny Qwen2-VL's
(scripts/build_tiny_model.py) with Qwen2-VL's own pixel limits: only the shapes matter, and its token ids all lie
inside the 2B's vocabulary.

The CPU stand-in (RECIPES_GPU_SUITE_ON_CPU=1) runs the same path on the tiny Qwen2-VL's shape in fp32: the plumbing,
not the GPU's figures. Anything missing (the model's class, the processor's image count, a step, the peak, the plan
line) fails the case with what was missing: the GPU check's summary shows it."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_support import HAS_GPU, MODEL_CACHE, ON_CPU, REPO, gpu_launch, gpu_suite  # noqa: E402

sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "scripts"))

pytestmark = gpu_suite

IMAGE_SIDE = 448  # pixels: 32 x 32 patches of 14, merged 2 x 2 into 256 tokens
IMAGE_TOKENS = 256
ROWS, EVAL_ROWS, STEPS, BATCH = 80, 8, 10, 8
# Qwen2-VL-2B-Instruct's config.json, its shape keys (the tiny processor's token ids are kept)
QWEN2_VL_2B_TEXT = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
                        hidden_act="silu", max_window_layers=28, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                         "mrope_section": [16, 24, 24]})
QWEN2_VL_2B_VISION = dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4, in_channels=3,
                          patch_size=14, spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu")
# Qwen2-VL's own image processor limits (its preprocessor_config.json): a 448 x 448 image keeps its size
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16384


def vision_model() -> Path:
    """The Qwen2-VL-2B-shaped model (the tiny one's shape on the CPU stand-in) with random weights, built on the
    GPU in bf16 and saved once (a temporary folder renamed into place), with the tiny Qwen2-VL's tokenizer and chat
    template and Qwen2-VL's pixel limits."""
    import os
    import shutil
    import tempfile

    import torch
    from build_tiny_model import build_tiny_vlm
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = MODEL_CACHE / ("tiny-qwen2-vl-448" if ON_CPU else "qwen2-vl-2b-shaped")
    if (folder / "config.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        build_tiny_vlm("qwen2-vl", building / "model")  # the tokenizer, chat template and processor files
        files = building / "model"
        config = json.loads((files / "config.json").read_text())
        ids = {key: config[key] for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                                            "vision_end_token_id")}
        if ON_CPU:
            text, vision = (config[key] for key in ("text_config", "vision_config"))
            text, vision = ({k: v for k, v in part.items() if k != "model_type"} for part in (text, vision))
            device, dtype = "cpu", torch.float32
        else:
            special = {key: config["text_config"][key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
            text, vision, device, dtype = {**QWEN2_VL_2B_TEXT, **special}, QWEN2_VL_2B_VISION, "cuda", torch.bfloat16
        shaped = Qwen2VLConfig(text_config=text, vision_config=vision,
                               tie_word_embeddings=text.get("tie_word_embeddings", False), **ids)
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen2VLForConditionalGeneration._from_config(shaped, dtype=dtype)
        model.generation_config = GenerationConfig.from_pretrained(str(files))  # stops at the turn's end
        for file in files.glob("model*.safetensors*"):
            file.unlink()
        (files / "config.json").unlink()
        model.save_pretrained(str(files))
        Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(str(files))
        os.replace(files, folder)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return folder


def image_rows(folder: Path, count: int, start: int = 0) -> Path:
    """`count` chat rows, each a 448 x 448 image of a shape on noise and a question whose answer is a sentence."""
    import numpy as np
    from PIL import Image, ImageDraw

    colours = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for number in range(start, start + count):
        generator = np.random.default_rng(number)
        image = Image.fromarray(generator.integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8))
        colour, shape = list(colours)[number % 4], ("circle", "square")[number // 4 % 2]
        x, y, size = (int(v) for v in generator.integers(40, IMAGE_SIDE - 200, 3))
        draw = getattr(ImageDraw.Draw(image), "ellipse" if shape == "circle" else "rectangle")
        draw([x, y, x + size // 2 + 60, y + size // 2 + 60], fill=colours[colour])
        path = folder / f"image_{number:04d}.png"
        image.save(path)
        answer = (f"The image shows a {colour} {shape} on a background of coloured noise; its left edge is {x} pixels "
                  f"from the left and its top edge {y} pixels from the top.")
        rows.append({"messages": [{"role": "user", "content": [{"type": "image"},
                                                               {"type": "text", "text": "Describe the shape."}]},
                                  {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                     "images": [str(path)]})
    path = folder / f"rows-{start}-{count}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def input_tokens(model: Path, rows: Path) -> list[int]:
    """Each row's tokens as the model takes them: the processor's, its image's placeholder expanded."""
    from common.data import images
    from common.model import modeling, processors

    tokenizer = modeling.load_tokenizer(str(model))
    processor = processors.load(str(model), tokenizer)
    assert processor is not None, f"{model}: no processor loads (the vision part of the check needs one)"
    counts = []
    for line in rows.read_text().splitlines():
        row = json.loads(line)
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        batch = images.prompt_inputs(processor, text, row["images"])
        counts.append(int(batch["input_ids"].shape[1]))
    expanded = images.prompt_inputs(processor, processor.image_token, row["images"])["input_ids"].shape[1]
    assert expanded == IMAGE_TOKENS, f"a {IMAGE_SIDE} x {IMAGE_SIDE} image gave {expanded} tokens, not {IMAGE_TOKENS}"
    return counts


def test_vision_language_lora_step_on_gpu(tmp_path, record_property):
    model = vision_model()
    train, evaluation = image_rows(tmp_path / "data", ROWS), image_rows(tmp_path / "data", EVAL_ROWS, start=ROWS)
    lengths = input_tokens(model, train)
    run = gpu_launch("lora", tmp_path / "out", "--dataset", str(train), "--eval-dataset", str(evaluation),
                     "--max-steps", str(STEPS), "--batch-size", str(BATCH), "--max-length", "1024", "--log-every", "0",
                     config="ddp", processes=1, model=model, timeout=600)
    assert run.returncode == 0, run.output[-4000:]
    metrics = run.metrics()
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), metrics
    plan = next((line for line in run.output.splitlines() if line.startswith("plan: ")), None)
    assert plan is not None, "the launch printed no plan line:\n" + run.output[-2000:]
    planned = re.search(r": ([\d.]+) (GiB|MiB) per ", plan)
    steps = [later["elapsed_s"] - earlier["elapsed_s"] for earlier, later in zip(metrics, metrics[1:])]
    step_s = statistics.median(steps)
    timed_s = metrics[-1]["elapsed_s"] - metrics[0]["elapsed_s"]
    figures = {
        "model": "Qwen2-VL-2B shape" if not ON_CPU else "tiny Qwen2-VL (CPU stand-in)",
        "image_tokens_a_row": IMAGE_TOKENS, "input_tokens_a_row": round(statistics.fmean(lengths), 1),
        "rows_a_step": BATCH, "step_s": round(step_s, 4), "first_step_s": metrics[0]["elapsed_s"],
        "target_tokens_per_s": round(sum(m["tokens"] for m in metrics[1:]) / timed_s, 1),
        # the rows are shuffled; every row is within a few tokens of the mean
        "input_tokens_per_s": round(BATCH * statistics.fmean(lengths) / step_s, 1),
        "compiled": run.run_json().get("arguments", {}).get("compile"),
        "planned_gib": (round(float(planned[1]) / (1 if planned[2] == "GiB" else 1024), 3) if planned else None),
        # the plan's figure and parts, and apart what it says of the vision tower and the images
        "plan": plan.split("; ")[0],
        "plan_vision": "; ".join(part for part in plan.split("; ")[1:] if re.search("vision|image|patches", part)),
        "end_to_end_s": round(run.seconds, 1),
    }
    if HAS_GPU:
        peaks = [m.get("peak_allocated_gib") for m in metrics]
        assert None not in peaks, f"metrics.jsonl has no peak_allocated_gib on a GPU: {metrics[-1]}"
        figures.update(peak_allocated_gib=max(peaks), peak_reserved_gib=max(m["peak_reserved_gib"] for m in metrics))
        if figures["planned_gib"]:
            figures["planned_over_measured"] = round(figures["planned_gib"] / figures["peak_allocated_gib"], 3)
    for name, value in figures.items():
        record_property(name, value)
    assert planned is not None or "skipped" in plan, f"the plan line gives no figure: {plan}"
