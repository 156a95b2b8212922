"""The one-line refusal every check uses: a run that cannot work stops before the model loads, with one
line naming the problem and the fix, printed once, and exit status 2. At the bottom of recipes/common/:
it imports nothing of the project."""

from __future__ import annotations

import os
import sys
import time

EXIT_REFUSED = 2


class Refusal(SystemExit):
    """A launch that cannot work; raised so tests can catch it, printed as one line otherwise."""

    def __init__(self, message: str):
        super().__init__(EXIT_REFUSED)
        self.message = message

    def __str__(self) -> str:
        return self.message


# How long another rank waits for rank 0 (which may start seconds later) to print a refusal every rank reached.
REFUSAL_GRACE_S = 30


def refuse(message: str) -> None:
    """Print the line once (rank 0) and stop. Every rank reaches the same verdict; the others wait
    a moment, because the launcher stops every rank as soon as one exits, and the first to exit
    must not be a silent one. A rank still running after the grace (rank 0 did not refuse) speaks."""
    rank = int(os.environ.get("RANK", "0"))
    launched = "LOCAL_RANK" in os.environ  # started by a launcher, not called in-process by a test
    if rank != 0 and launched:
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's stop must stop this rank, not checkpoint it
        time.sleep(REFUSAL_GRACE_S)
    if rank == 0 or launched:
        from tqdm import tqdm

        tqdm.write(f"error: {message}", file=sys.stderr)  # on a line of its own, even under a progress bar
    record_for_the_launcher(f"error: {message}")
    raise Refusal(message)


def record_for_the_launcher(line: str) -> None:
    """torch's launcher ends a failed run with its own report (a traceback and a summary of the failed
    ranks, ~35 lines) below everything the ranks printed. A rank's error file is where that summary
    takes its message from: written there, the refusal is also the summary's last words."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json

    try:
        with open(path, "w") as file:
            json.dump({"message": line, "timestamp": int(time.time())}, file)
    except OSError:  # the line was printed above; the summary only repeats it
        pass
