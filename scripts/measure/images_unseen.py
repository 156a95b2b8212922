#!/usr/bin/env python
"""Images in rows the tests never see: a family (Qwen2.5-VL, window attention in its vision tower), an image set (the
held-out images of data/vision) and a row layout (ShareGPT's `conversations` of `from` / `value`, `<image>` in the
text, one `image` column) that tests/test_images.py does not use, trained by recipes/lora.py under DDP and ZeRO-3
(2 processes) beside TRL's SFTTrainer (one process), the same rows, model and adapter, float32 on CPU:

    python scripts/measure/images_unseen.py --output-dir outputs/images-unseen

The model: a tiny random Qwen2.5-VL, the tiny Qwen2-VL's text model, tokenizer, processor files and chat template
(scripts/build_tiny_model.py --family qwen2-vl) with a Qwen2.5-VL vision tower. 16 rows, 3 steps of the whole 16:
ours as 4 rows x 2 micro-batches x 2 processes; TRL's as one micro-batch of 16 and as 8 x 2 micro-batches.
Writes --output-dir/summary.json (each side's loss and gradient norm at each step).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VISION = REPO / "data" / "vision"


def tiny_qwen2_5_vl(folder: Path) -> None:
    """The tiny Qwen2-VL's folder with its model swapped for a Qwen2.5-VL of the same text model."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    source = REPO / "models" / "tiny-qwen2-vl"
    if not (source / "config.json").is_file():
        subprocess.run([sys.executable, "scripts/build_tiny_model.py", "--family", "qwen2-vl"], cwd=REPO, check=True)
    shutil.copytree(source, folder, dirs_exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    text = {key: value for key, value in config["text_config"].items() if key not in ("model_type", "architectures")}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, fullatt_block_indexes=[1],
                  window_size=56)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=config["image_token_id"],
        video_token_id=config["video_token_id"], vision_start_token_id=config["vision_start_token_id"],
        vision_end_token_id=config["vision_end_token_id"]))
    model.save_pretrained(str(folder))
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}) + "\n")


def sharegpt_rows(path: Path, count: int) -> None:
    """The first `count` held-out vision rows as ShareGPT conversations with `<image>` in the text."""
    with open(path, "w") as file:
        for line in (VISION / "eval.jsonl").read_text().splitlines()[:count]:
            row = json.loads(line)
            question = row["messages"][0]["content"][1]["text"]
            answer = row["messages"][1]["content"][0]["text"]
            file.write(json.dumps({"conversations": [{"from": "human", "value": f"<image>\n{question}"},
                                                     {"from": "gpt", "value": answer}],
                                   "image": str(VISION / row["images"][0])}) + "\n")


def steps(metrics: Path) -> list[dict]:
    return [{"step": record["step"], "loss": record["loss"], "grad_norm": record["grad_norm"]}
            for record in map(json.loads, metrics.read_text().splitlines()) if record["type"] == "train"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/images-unseen"))
    args = parser.parse_args(argv)
    out = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model, rows = out / "tiny-qwen2.5-vl", out / "rows.jsonl"
    tiny_qwen2_5_vl(model)
    sharegpt_rows(rows, 16)
    flags = ["--model", str(model), "--dataset", str(rows), "--max-steps", "3", "--lr", "5e-3", "--lora-dropout", "0"]
    sides = {}
    for name, shape in (("trl, 16 x 1", ["--batch-size", "16", "--grad-accum", "1"]),
                        ("trl, 8 x 2", ["--batch-size", "8", "--grad-accum", "2"])):
        folder = out / name.replace(", ", "-").replace(" ", "")
        subprocess.run([sys.executable, "scripts/measure/trl_vlm_worker.py", "--output-dir", str(folder), *flags, *shape],
                       cwd=REPO, check=True, capture_output=True)
        sides[name] = steps(folder / "metrics.jsonl")
    for config in ("ddp", "zero3"):
        folder = out / config
        subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                        f"accelerate_configs/{config}.yaml", "--num_processes", "2", "--mixed_precision", "no",
                        "recipes/lora.py", *flags, "--eval-dataset", str(rows), "--batch-size", "4", "--grad-accum", "2",
                        "--output-dir", str(folder)], cwd=REPO, check=True, capture_output=True)
        sides[f"lora.py, {config}, 4 x 2 x 2 processes"] = steps(folder / "metrics.jsonl")
    summary = {"command": "python scripts/measure/images_unseen.py", "rows": 16, "sides": sides}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for name, records in sides.items():
        print(f"{name:36s}", "  ".join(f"step {r['step']}: {r['loss']:.6f} / {r['grad_norm']:.6f}" for r in records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
