#!/usr/bin/env python
"""Each rank's peak unique memory (USS) while a launch runs, split at its output's milestones, and the
seconds to its first step.

    python launch_memory.py --out run.json -- python -m accelerate.commands.launch ... recipes/lora.py ...

A rank is a child of the launched command with RANK in its environment (accelerate's launcher starts
them; a command that is one process is rank 0 itself). Every --interval seconds each rank's
/proc/PID/smaps_rollup is read: USS is Private_Clean + Private_Dirty (what only that process holds:
its anonymous memory and the pages of the memory-mapped Arrow files no other process maps), beside
its anonymous memory and its resident size; VmHWM (the kernel's own resident peak) is read too.

Phases, by the lines the recipe prints: `preparing` until the data line (`data (...)`: files read,
rows tokenised, the usable ones selected), `packing and loading` until the run line (`lora: ...`: the
rows packed where --packing asks, the model loaded), `first step` until `step 1:`, `rest` after
(evaluation, saving); `data` is the first two together. The output is passed through; the record is
written to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "measure"))
from data_speed import rank_of  # noqa: E402  (a process's RANK, from its environment)

MIB = 2 ** 20


def rollup(pid: int) -> dict:
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":")
        fields[name] = int(value.split()[0]) * 1024
    high = re.search(r"VmHWM:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    return {"uss": fields["Private_Clean"] + fields["Private_Dirty"], "anonymous": fields["Anonymous"],
            "rss": fields["Rss"], "vm_hwm": int(high.group(1)) * 1024 if high else 0}


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


class RankPeaks:
    """Peaks per rank and phase, sampled in a thread."""

    def __init__(self, root: int, interval: float):
        self.root, self.interval = root, interval
        self.phase = "preparing"
        self.peaks: dict[int, dict[str, dict[str, int]]] = {}
        self.ranks: dict[int, int] = {}  # pid -> rank
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _find_ranks(self):
        for pid in children_of(self.root):
            if pid not in self.ranks:
                rank = rank_of(pid)
                if rank is not None:
                    self.ranks[pid] = rank

    def _run(self):
        last_search = 0.0
        while not self.done.is_set():
            if time.perf_counter() - last_search > 1.0:  # the ranks start once; look for them now and then
                self._find_ranks()
                last_search = time.perf_counter()
            pids = dict(self.ranks) or {self.root: 0}
            for pid, rank in pids.items():
                try:
                    sample = rollup(pid)
                except (OSError, ValueError, KeyError):
                    continue
                phase = self.peaks.setdefault(rank, {}).setdefault(self.phase, dict.fromkeys(sample, 0))
                for name, value in sample.items():
                    phase[name] = max(phase[name], value)
            self.done.wait(self.interval)

    def stop(self) -> dict:
        self.done.set()
        self.thread.join()
        by_rank = {}
        for rank, phases in sorted(self.peaks.items()):
            whole = {name: max(phase[name] for phase in phases.values()) for name in next(iter(phases.values()))}
            before_training = [phases[name] for name in ("preparing", "packing and loading") if name in phases]
            if before_training:
                phases["data"] = {name: max(phase[name] for phase in before_training) for name in before_training[0]}
            by_rank[rank] = {"peak": {name: round(value / MIB) for name, value in whole.items()},
                             **{phase: {name: round(value / MIB) for name, value in values.items()}
                                for phase, values in phases.items()}}
        return by_rank


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)  # --help, or no command: argparse answers
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between samples (default 0.05)")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        parser.error("give the command to watch after --")
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    peaks = RankPeaks(process.pid, args.interval)
    marks = {}
    for line in process.stdout:
        sys.stdout.write(line)
        if re.match(r"data[ :]", line) and "prepared_s" not in marks:  # the data line: rows read and tokenised
            marks["prepared_s"] = round(time.perf_counter() - started, 1)
            peaks.phase = "packing and loading"
        elif re.match(r"\w+: \w+ x \d+ process", line) and "data_s" not in marks:  # the run line: data and model ready
            marks["data_s"] = round(time.perf_counter() - started, 1)
            peaks.phase = "first step"
        elif line.startswith("step 1:") and "first_step_s" not in marks:
            marks["first_step_s"] = round(time.perf_counter() - started, 1)
            peaks.phase = "rest"
        elif line.startswith("packing:"):
            marks["packing_line"] = line.strip()
    process.wait()
    record = {"command": command, "returncode": process.returncode,
              "wall_s": round(time.perf_counter() - started, 1), **marks, "mib_by_rank": peaks.stop()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({key: value for key, value in record.items() if key != "command"}), file=sys.stderr)
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
