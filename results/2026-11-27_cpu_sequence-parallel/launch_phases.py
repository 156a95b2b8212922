#!/usr/bin/env python
"""Each rank's peak unique memory (USS) in a launch's training steps and, apart, in its evaluation and saving.

    python launch_phases.py --out run.json --last-step 3 -- python -m accelerate.commands.launch ...

The sampling is launch_memory.py's (results/2026-11-27_cpu_packing-memory/); the phases here: `loading` until
the run line (`lora: ...`), `training` until the last step's line (`step N:`, printed once its update is done),
`evaluation and saving` after it (the final evaluation, which runs each sequence whole on one rank).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-11-27_cpu_packing-memory"))
from launch_memory import RankPeaks  # noqa: E402


def main() -> int:
    split = sys.argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--last-step", type=int, required=True)
    parser.add_argument("--interval", type=float, default=0.1)
    args = parser.parse_args(sys.argv[1:split])
    started = time.perf_counter()
    process = subprocess.Popen(sys.argv[split + 1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               bufsize=1)
    peaks = RankPeaks(process.pid, args.interval)
    peaks.phase = "loading"
    for line in process.stdout:
        sys.stdout.write(line)
        if re.match(r"\w+: \w+ x \d+ process", line):
            peaks.phase = "training"
        elif line.startswith(f"step {args.last_step}:"):
            peaks.phase = "evaluation and saving"
    process.wait()
    record = {"command": sys.argv[split + 1:], "returncode": process.returncode,
              "wall_s": round(time.perf_counter() - started, 1), "mib_by_rank": peaks.stop()}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
