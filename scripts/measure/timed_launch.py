"""A recipe's launch as the harnesses here time it (vision_task.py, real_model_quickstart.py): the command printed,
run through accelerate's launcher in this Python, its output kept in console.txt, the seconds from the launch to
its end."""

from __future__ import annotations

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
