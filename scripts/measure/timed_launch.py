"""A recipe's launch as the harnesses here time it (vision_task.py, real_model_quickstart.py): the command printed,
run through accelerate's launcher in this Python, its output kept in console.txt, the seconds from the launch to
its end, and what its run.json and metrics.jsonl say of memory and evaluation."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def timed_launch(command: list[str], console: Path) -> float | None:
    """Seconds from `accelerate launch ...` (`command`, as a user types it) to its end; None when it failed (its
    last lines printed). Its whole output goes to `console`."""
    print("$", " ".join(command), flush=True)
    started = time.monotonic()
    launch = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", *command[2:]], cwd=REPO,
                            capture_output=True, text=True)
    seconds = round(time.monotonic() - started, 1)
    console.write_text(launch.stdout + launch.stderr)
    if launch.returncode != 0:
        print((launch.stdout + launch.stderr)[-3000:])
        return None
    return seconds


def launched(command: list[str], out: Path) -> dict | None:
    """`timed_launch` of a run whose --output-dir is `out / "run"` (console.txt in `out`), with its figures: the
    command, the seconds to the end, each rank's host peak, the evaluation exact match by step. None when it
    failed."""
    seconds = timed_launch(command, out / "console.txt")
    if seconds is None:
        return None
    run = json.loads((out / "run" / "run.json").read_text())
    evals = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"command": " ".join(command), "launch_to_adapter_s": seconds,
            "host_peak_gib_by_rank": run["host_peak_gib_by_rank"],
            "eval_exact_match_by_step": {r["step"]: r["eval_exact_match"] for r in evals if r["type"] == "eval"}}
