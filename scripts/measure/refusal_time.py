#!/usr/bin/env python
"""Seconds from `accelerate launch` to a refusal's line, for the mistakes that need no model or library (a missing
or malformed file, a typo in a flag, pairs given to an SFT recipe, grpo.py without a reward), 2 processes under
ddp.yaml on CPU, each launch as a user types it:

    python scripts/measure/refusal_time.py --output-dir outputs/refusal-time [--before PATH] [--repeats 3]

--before PATH times the same launches in another checkout (e.g. `git worktree add PATH <commit>`), alternating
with this one, so both sides see the same machine load. Writes --output-dir/summary.json (each case's command, the
refusal's last line, the median seconds of each side) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cases(data: Path) -> dict[str, list[str]]:
    """case -> the recipe and its flags (files under `data`, written by write_inputs)."""
    return {
        "missing dataset file": ["lora.py", "--dataset", str(data / "nope.jsonl")],
        "typo in a flag": ["lora.py", "--learning-rate", "1e-4"],
        "malformed JSON line": ["lora.py", "--dataset", str(data / "broken.jsonl")],
        "pairs given to lora.py": ["lora.py", "--dataset", str(data / "pairs.jsonl")],
        "grpo.py without a reward": ["grpo.py", "--dataset", str(data / "prompts.jsonl")],
        "missing reward file": ["grpo.py", "--dataset", str(data / "prompts.jsonl"), "--reward", "nope.py:f"],
    }


def write_inputs(data: Path) -> None:
    data.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": f"Sort: {i} 1", "completion": f"1 {i}"} for i in range(100)]
    lines = [json.dumps(row) for row in rows]
    (data / "broken.jsonl").write_text("\n".join(lines[:50] + ['{"prompt": "unclosed'] + lines[50:]) + "\n")
    (data / "pairs.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "chosen": r["completion"],
                                                          "rejected": "no"}) + "\n" for r in rows))
    (data / "prompts.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows))


def timed(repo: Path, recipe_args: list[str], out: Path) -> tuple[float, str]:
    """(seconds to the launcher's exit, the last line naming the error) of one refused launch in `repo`."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(repo / "accelerate_configs" / "ddp.yaml"), "--num_processes", "2", "--mixed_precision", "no",
               str(repo / "recipes" / recipe_args[0]), "--output-dir", str(out), *recipe_args[1:]]
    started = time.monotonic()
    done = subprocess.run(command, cwd=repo, capture_output=True, text=True)
    seconds = time.monotonic() - started
    if done.returncode == 0:
        raise SystemExit(f"{' '.join(recipe_args)} trained instead of being refused")
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "error:" in line]
    return seconds, (errors[-1].split("error:", 1)[1].strip() if errors else "(no error line)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="outputs/refusal-time")
    parser.add_argument("--before", default=None, help="another checkout, timed alternately with this one")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    out = Path(args.output_dir).resolve()
    write_inputs(out / "data")
    sides = {"now": REPO, **({"before": Path(args.before).resolve()} if args.before else {})}
    summary = {}
    for case, recipe_args in cases(out / "data").items():
        seconds = {side: [] for side in sides}
        lines = {}
        for repeat in range(args.repeats):
            for side, repo in sides.items():
                took, lines[side] = timed(repo, recipe_args, out / "run")
                seconds[side].append(took)
        summary[case] = {"command": "accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 "
                                    "--mixed_precision no recipes/" + " ".join(recipe_args).replace(str(out), "OUT"),
                         "line": lines["now"], **{f"{side}_s": round(statistics.median(values), 1)
                                                  for side, values in seconds.items()},
                         **({"line_before": lines["before"]} if "before" in lines else {})}
        print(f"{case}: " + ", ".join(f"{side} {summary[case][f'{side}_s']} s" for side in sides)
              + f"  ({lines['now'][:90]})", flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
