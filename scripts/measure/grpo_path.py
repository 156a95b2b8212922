#!/usr/bin/env python
"""The user's path from SFT to GRPO on the bundled task, measured: does GRPO with a correctness reward raise the
held-out exact match above the SFT model's?

    python scripts/measure/grpo_path.py --output-dir outputs/grpo-path

1. SFT: README's quickstart (recipes/lora.py, 2-process DDP on CPU, 300 steps on data/train.jsonl).
2. GRPO from the adapter it saved (recipes/grpo.py, the same launch): the bundled prompts (data/prompts/), the
   exact-answer reward (recipes/rewards.py:exact_answer), 8 completions a prompt at temperature 0.5, top-k 3.
   Its evaluation before the first step is the SFT model's greedy exact match on the 128 held-out prompts; its
   last, the GRPO model's.

Prints both launches' figures and writes --output-dir/summary.json (the exact matches, each launch's wall time
and command) and curves.png (scripts/plot.py on the GRPO run). --grpo-steps / --sft-steps shorten it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml",
          "--num_processes", "2", "--mixed_precision", "no"]


def launched(command: list[str]) -> float:
    """Run one launch to its end (its output passed through); its wall time in seconds."""
    print("$ accelerate launch", " ".join(command[3:]), flush=True)
    started = time.monotonic()
    subprocess.run(command, cwd=REPO, check=True)
    return round(time.monotonic() - started, 1)


def evals(folder: Path) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["type"] == "eval"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/grpo-path"))
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--grpo-steps", type=int, default=1000)
    args = parser.parse_args(argv)
    out = args.output_dir.resolve()
    sft = [*LAUNCH, "recipes/lora.py", "--max-steps", str(args.sft_steps), "--lr", "3e-3", "--lora-r", "32",
           "--eval-every", str(args.sft_steps), "--log-every", "100", "--output-dir", str(out / "sft")]
    grpo = [*LAUNCH, "recipes/grpo.py", "--model", str(out / "sft" / "adapter"), "--max-steps", str(args.grpo_steps),
            "--lr", "1e-3", "--lora-r", "32", "--batch-size", "16", "--num-generations", "8",
            "--max-completion-length", "10", "--temperature", "0.5", "--top-k", "3",
            "--eval-every", str(max(1, args.grpo_steps // 10)), "--log-every", "100", "--output-dir", str(out / "grpo")]
    seconds = {"sft": launched(sft), "grpo": launched(grpo)}
    sft_eval, grpo_evals = evals(out / "sft")[-1], evals(out / "grpo")
    summary = {
        "sft_teacher_forced_exact_match": sft_eval["eval_exact_match"],
        "sft_greedy_exact_match": grpo_evals[0]["eval_rewards/exact_answer/mean"],  # GRPO's evaluation at step 0
        "grpo_greedy_exact_match": grpo_evals[-1]["eval_rewards/exact_answer/mean"],
        "grpo_exact_match_by_step": {record["step"]: record["eval_rewards/exact_answer/mean"] for record in grpo_evals},
        "held_out_prompts": 128, "seconds": seconds,
        "commands": {name: " ".join(["accelerate", "launch", *command[3:]]) for name, command in
                     (("sft", sft), ("grpo", grpo))},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    subprocess.run([sys.executable, "scripts/plot.py", str(out / "grpo"), "--output", str(out / "curves.png")],
                   cwd=REPO, check=True)
    print(f"held-out greedy exact match: SFT {summary['sft_greedy_exact_match']:.4f}, "
          f"after GRPO {summary['grpo_greedy_exact_match']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
