#!/usr/bin/env python
"""README's vision step, measured: a tiny random vision-language model learns the bundled vision task (data/vision:
one shape a 56x56 image; its colour or its kind the answer) with LoRA under 2-process DDP on CPU.

    python scripts/measure/vision_task.py --output-dir outputs/vision-task [--family qwen2-vl] [--steps 200]

1. The model, built offline (scripts/build_tiny_model.py --family F into models/tiny-F, when missing).
2. The launch (recipes/lora.py, ddp.yaml, 2 processes), its console output kept (console.txt), timed from the
   launch to the adapter saved.
3. Greedy answers to every held-out question, with its image, through scripts/generate.py's own loading and
   prompting, by the untrained model and by the run's adapter on it: how many are exactly right, by question.

Writes --output-dir/summary.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))

from timed_launch import launched  # noqa: E402
VISION = REPO / "data" / "vision"


def greedy_answers(model: str, rows: list[dict]) -> list[str]:
    """generate.py's greedy answer to each held-out row's question, its image given with it."""
    sys.path.insert(0, str(REPO / "scripts"))
    import generate
    from common.model.processors import load as load_processor

    run, folder = generate.find_model(model, "auto")
    tokenizer = generate.load_tokenizer(folder)
    processor = load_processor(folder, tokenizer, config_from=generate.adapters.adapter_base(folder) or folder)
    loaded = generate.load(folder, run, "cpu").eval()
    replies = []
    for row in rows:
        ids = generate.prompt_ids(question(row), tokenizer, "messages", False, None, image_count=1)
        replies.append(generate.answer(loaded, tokenizer, ids, 8, "cpu", processor=processor,
                                       image_files=[str(VISION / row["images"][0])]).strip())
    return replies


def question(row: dict) -> str:
    return next(part["text"] for part in row["messages"][0]["content"] if part["type"] == "text")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/vision-task"))
    parser.add_argument("--family", default="qwen2-vl", choices=("qwen2-vl", "llava"))
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    out = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = REPO / "models" / f"tiny-{args.family}"
    if not (model / "config.json").is_file():
        subprocess.run([sys.executable, "scripts/build_tiny_model.py", "--family", args.family], cwd=REPO, check=True)

    command = ["accelerate", "launch", "--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "2",
               "--mixed_precision", "no", "recipes/lora.py", "--model", f"models/tiny-{args.family}", "--dataset",
               "data/vision", "--max-steps", str(args.steps), "--lr", "2e-3", "--batch-size", "8", "--grad-accum", "1",
               "--eval-every", str(max(1, args.steps // 4)), "--log-every", "25", "--output-dir", str(out / "run")]
    figures = launched(command, out)
    if figures is None:
        return 1

    sys.path.insert(0, str(REPO / "recipes"))
    rows = [json.loads(line) for line in (VISION / "eval.jsonl").read_text().splitlines()]
    expected = [row["messages"][1]["content"][0]["text"] for row in rows]
    before, after = greedy_answers(str(model), rows), greedy_answers(str(out / "run"), rows)
    asked = [question(row) for row in rows]

    def right(replies: list[str]) -> dict:
        counts = Counter(q for q, reply, answer in zip(asked, replies, expected) if reply == answer)
        return {"all": sum(counts.values()), **{q: counts[q] for q in sorted(set(asked))}}

    summary = {
        **figures,
        "held_out_rows": len(rows), "questions": dict(Counter(asked)),
        "greedy_right": {"untrained": right(before), "after_the_run": right(after)},
        "examples": [{"question": q, "image": row["images"][0], "expected": e, "untrained": b, "after_the_run": a}
                     for q, row, e, b, a in list(zip(asked, rows, expected, before, after))[:6]],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("launch_to_adapter_s", "greedy_right", "eval_exact_match_by_step")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
