#!/usr/bin/env python
"""recipes/dpo.py beside TRL's DPOTrainer (--loss orpo: trl.experimental's ORPOTrainer; --recipe kto: recipes/kto.py
beside KTOTrainer; --recipe reward: recipes/reward.py beside RewardTrainer) on the same workload: time per optimizer
step, side by side.

    python scripts/measure/compare_trl_dpo.py --steps 40 --rounds 3 --output-dir outputs/compare_trl_dpo [--loss orpo]
    python scripts/measure/compare_trl_dpo.py --recipe kto --steps 40 --rounds 3 --output-dir outputs/compare_trl_kto
    python scripts/measure/compare_trl_dpo.py --recipe reward --steps 40 --rounds 3 --output-dir outputs/compare_trl_reward

Both sides train the bundled tiny model's LoRA adapters on the bundled pairs (data/preferences/train.jsonl,
prompt / chosen / rejected text), one process, fp32 on CPU, with the recipe's flags (scripts/measure/trl_dpo_worker.py
sets DPOTrainer up as the recipe runs: the same adapter, optimizer, schedule, beta and loss; the reference
is the base with the adapter switched off on both sides). The rounds alternate the two sides. A side's time
is its training loop from the end of its first step to the end of its last (the first step's warm-up left
out), from each step's `elapsed_s` in its metrics.jsonl; pairs/s = pairs trained in those steps / that time
(KTO: rows/s, each pair two judged replies, scripts/measure/trl_kto_worker.py its TRL side; reward models: pairs/s,
scripts/measure/trl_reward_worker.py its TRL side, both with the LoRA targets named: --lora-targets all-linear would
adapt the score head too on TRL's sequence classifier).
Prints a line per run, the medians and `ratio: X` (ours / TRL's pairs per second; above 1: ours is faster);
writes --output-dir/summary.json. What it does not measure: GPUs, several processes, data preparation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAIRS = REPO / "data" / "preferences" / "train.jsonl"


def metrics(folder: Path) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["type"] == "train"]


def pairs_per_second(records: list[dict], pairs_per_step: int) -> tuple[float, float]:
    """(pairs/s, seconds) over steps 2..last."""
    seconds = records[-1]["elapsed_s"] - records[0]["elapsed_s"]
    return (len(records) - 1) * pairs_per_step / seconds, seconds


def run_side(side: str, folder: Path, flags: list[str], recipe: str = "dpo") -> None:
    if side == "ours":
        command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
                   "--num_machines", "1", "--dynamo_backend", "no", "--mixed_precision", "no",
                   str(REPO / "recipes" / f"{recipe}.py"), "--output-dir", str(folder), *flags, "--eval-every", "0",
                   "--no-eval-on-start"]
    else:
        command = [sys.executable, str(REPO / "scripts" / "measure" / f"trl_{recipe}_worker.py"), "--output-dir",
                   str(folder), *flags]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{side} failed:\n{(done.stdout + done.stderr)[-3000:]}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--recipe", choices=("dpo", "kto", "reward"), default="dpo",
                        help="kto: recipes/kto.py beside KTOTrainer; reward: recipes/reward.py beside RewardTrainer")
    parser.add_argument("--loss", default="sigmoid", help="dpo.py's --loss (orpo: against ORPOTrainer)")
    parser.add_argument("--output-dir", type=Path, default=REPO / "outputs" / "compare_trl_dpo")
    args = parser.parse_args(argv)
    flags = ["--dataset", str(PAIRS), "--max-steps", str(args.steps), "--batch-size", str(args.batch_size),
             "--grad-accum", "1", "--lr", "5e-3", "--lora-dropout", "0",
             *(["--loss", args.loss] if args.recipe == "dpo" else []),
             *(["--lora-targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"] if args.recipe == "reward" else [])]
    unit = "rows" if args.recipe == "kto" else "pairs"
    runs = {"ours": [], "TRL": []}
    for round_ in range(1, args.rounds + 1):
        for side in runs:
            folder = args.output_dir / f"round{round_}-{side.lower()}"
            run_side(side, folder, flags, args.recipe)
            speed, seconds = pairs_per_second(metrics(folder), args.batch_size)
            runs[side].append(speed)
            print(f"round {round_}  {side:<4} {speed:8.1f} {unit}/s  {args.steps} steps  timed {seconds:.2f} s",
                  flush=True)
    medians = {side: statistics.median(speeds) for side, speeds in runs.items()}
    ratio = medians["ours"] / medians["TRL"]
    print(f"median {unit}/s: ours {medians['ours']:.1f}, TRL {medians['TRL']:.1f}")
    print(f"ratio: {ratio:.2f}")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "summary.json").write_text(json.dumps(
        {f"{unit}_per_s": runs, f"median_{unit}_per_s": medians, "ratio": ratio, "steps": args.steps,
         "batch_size": args.batch_size, "rounds": args.rounds, "recipe": args.recipe,
         **({"loss": args.loss} if args.recipe == "dpo" else {})}, indent=2) + "\n")


if __name__ == "__main__":
    main()
