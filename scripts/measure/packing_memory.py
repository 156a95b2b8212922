"""Time and memory of --packing on a dataset, in one process, as rank 0 of a launch does it.

    python scripts/measure/packing_memory.py --dataset rows.jsonl [--model M] [--max-length 1024]

Reads and tokenises the rows through the recipes' data path (datasets' cache reused), keeps the
usable ones, then packs them, sampling the process's memory every 50 ms. Prints one JSON line: the
seconds packing took, the sequences and fill ratio, and the peaks before and during packing of
anonymous memory (what the process really holds) and of resident memory (which also counts the
pages of memory-mapped Arrow files it read, which the kernel drops when memory is short).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))
from common.paths import DEFAULT_MODEL  # noqa: E402


class MemorySampler:
    """Peaks of RssAnon and VmRSS (MiB) from /proc/self/status, sampled in a thread."""

    FIELDS = ("RssAnon", "VmRSS")

    def __init__(self):
        self.peak = dict.fromkeys(self.FIELDS, 0)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            for line in Path("/proc/self/status").read_text().splitlines():
                name = line.split(":")[0]
                if name in self.FIELDS:
                    self.peak[name] = max(self.peak[name], int(line.split()[1]) // 1024)
            time.sleep(0.05)

    def take(self) -> dict:
        peak, self.peak = self.peak, dict.fromkeys(self.FIELDS, 0)
        return {f"{name}_mib": value for name, value in peak.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--max-length", type=int, default=1024)
    args = parser.parse_args(argv)
    from common.data import checked_rows, packing, tokens  # after the flags: --help answers at once
    from common.model import modeling

    sampler = MemorySampler()
    tokenizer = modeling.load_tokenizer(args.model)
    train, _ = checked_rows.load_splits(args.dataset, 42, None)
    tokenized, _ = tokens.tokenize_counted(train, tokenizer, args.max_length)
    kept = tokens.usable(tokenized, "training", args)
    packing.packed_path(kept, args.max_length).unlink(missing_ok=True)  # measure the packing, not a reuse
    before = sampler.take()
    started = time.perf_counter()
    packed, fill = packing.pack(kept, args.max_length)
    seconds = time.perf_counter() - started
    print(json.dumps({"rows": len(kept), "sequences": len(packed), "fill": round(fill, 4), "max_length": args.max_length,
                      "pack_seconds": round(seconds, 1), "peak_before_packing": before,
                      "peak_while_packing": sampler.take()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
