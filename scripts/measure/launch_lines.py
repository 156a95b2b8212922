#!/usr/bin/env python
"""The lines of README's quickstart launch that are not the recipe's (libraries' progress bars, banners, the
launcher's warnings), counted, in this checkout and, with --before, another one (e.g. `git worktree add PATH
<commit>`), the same command in each:

    python scripts/measure/launch_lines.py --output-dir outputs/launch-lines [--before PATH]

A line is the recipe's when it starts as the recipe's lines do (`plan:`, `data ...:`, `step N:`, `eval at step N:`,
`sample:`, `done:`, ...); a progress bar's redraws (carriage returns) count as one line each. Writes
--output-dir/summary.json (per side: the command, the counts, the other lines as printed) and each console.txt.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# README's step 1, the launch after `pip install -r requirements.txt && `
QUICKSTART = ["--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "2", "--mixed_precision", "no",
              "recipes/lora.py", "--max-steps", "300", "--lr", "3e-3", "--lora-r", "32", "--eval-every", "100",
              "--log-every", "50"]
RECIPE_LINE = re.compile(r"^(plan|files|data|data cache|steps|model|lora|config|hub|eval at step \d+|step \d+|sample|"
                         r"done|tokenising \d[\d,]* rows|benchmarks|training)\b[^|]*$")


def console_lines(text: str) -> list[str]:
    return [line for line in re.split(r"[\r\n]", text) if line.strip()]


def measured(repo: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "accelerate.commands.launch", *QUICKSTART, "--output-dir", str(out / "run")]
    done = subprocess.run(command, cwd=repo, capture_output=True, text=True)
    text = done.stdout + done.stderr
    (out / "console.txt").write_text(text)
    if done.returncode != 0:
        raise SystemExit(f"the quickstart failed in {repo}:\n{text[-3000:]}")
    lines = console_lines(text)
    others = [line for line in lines if not RECIPE_LINE.match(line)]
    return {"repo": str(repo), "command": "accelerate launch " + " ".join(QUICKSTART) + " --output-dir OUT",
            "lines": len(lines), "recipe_lines": len(lines) - len(others), "other_lines": len(others),
            "others": others}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="outputs/launch-lines")
    parser.add_argument("--before", default=None, help="another checkout, launched the same way")
    args = parser.parse_args()
    out = Path(args.output_dir).resolve()
    sides = {"now": REPO, **({"before": Path(args.before).resolve()} if args.before else {})}
    summary = {side: measured(repo, out / side) for side, repo in sides.items()}
    for side, figures in summary.items():
        print(f"{side}: {figures['other_lines']} of {figures['lines']} lines not the recipe's", flush=True)
        for line in figures["others"]:
            print(f"    {line[:150]}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
