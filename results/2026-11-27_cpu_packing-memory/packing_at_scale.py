#!/usr/bin/env python
"""Packing's memory at 200,000 and 2,000,000 rows without tokenising them: a rank's data stage on a
generated tokenised set, with and without packing.

    python packing_at_scale.py write --lengths-from A.arrow [B.arrow ...] --rows N --out DIR
    python packing_at_scale.py measure --set DIR --mode plain|packed [--recipes DIR] [--keep-plan]

`write` draws N row lengths (seeded, with replacement) from real tokenised rows (the recipes' cache files
of a launch: their `input_ids` lengths) and writes DIR/tokenised.arrow as the recipes' cache holds a
tokenised set: an Arrow stream of int32 `input_ids` and `labels` (the first token masked), record batches
of 1,000 rows, random token ids below 32,000.

`measure` is one fresh process doing what a rank does with the usable rows once they are tokenised: the
set memory-mapped and selected, then (--mode packed) `packing.pack` at --max-length 1024, then the
training loader (--batch-size 8) and its first micro-batch. The plan saved beside the set is removed first
(the rank that computes it) unless --keep-plan (the ranks that read it). --recipes: whose recipes/ to
import (another commit's, exported). Prints one JSON line: this process's USS and anonymous memory (MiB,
/proc/self/smaps_rollup, sampled every 0.02 s) after opening the set, at its peak during the stage and
after it; Python's + Arrow's peak allocations during the stage (bytes: tracemalloc and a counting Arrow
pool); the seconds; the plan's size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIB = 2 ** 20


def write(lengths_from: list[str], rows: int, out: Path) -> None:
    import datasets
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    real = np.concatenate([pc.list_value_length(datasets.Dataset.from_file(path).data.column("input_ids"))
                           .to_numpy(zero_copy_only=False) for path in lengths_from])
    real = real[real > 0]  # rows that were dropped hold no tokens
    rng = np.random.default_rng(0)
    lengths = rng.choice(real, size=rows)
    out.mkdir(parents=True, exist_ok=True)
    schema = pa.schema({"input_ids": pa.list_(pa.int32()), "labels": pa.list_(pa.int32())})
    with pa.OSFile(str(out / "tokenised.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for first in range(0, rows, 1000):
            part = lengths[first:first + 1000]
            offsets = np.concatenate([[0], np.cumsum(part)]).astype(np.int32)
            ids = rng.integers(4, 32_000, size=int(offsets[-1]), dtype=np.int32)
            labels = ids.copy()
            labels[offsets[:-1]] = -100
            writer.write_batch(pa.record_batch([pa.ListArray.from_arrays(offsets, ids),
                                                pa.ListArray.from_arrays(offsets, labels)], schema=schema))
    print(json.dumps({"rows": rows, "tokens": int(lengths.sum()), "mean_length": round(float(lengths.mean()), 1),
                      "drawn_from": len(real), "file_bytes": (out / "tokenised.arrow").stat().st_size}))


def memory() -> dict:
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":")
        fields[name] = int(value.split()[0]) * 1024
    return {"uss": fields["Private_Clean"] + fields["Private_Dirty"], "anonymous": fields["Anonymous"]}


class Peaks:
    def __init__(self):
        self.peak = memory()
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self.done.wait(0.02):
            now = memory()
            self.peak = {name: max(value, now[name]) for name, value in self.peak.items()}


def measure(args) -> None:
    import gc
    import tracemalloc

    sys.path.insert(0, str(args.recipes))
    import datasets
    import numpy as np
    import pyarrow as pa
    from common.data import batches, packing

    datasets.disable_progress_bars()
    tokenized = datasets.Dataset.from_file(str(args.set / "tokenised.arrow"))
    usable = tokenized.select(np.arange(len(tokenized)))  # every row kept, as kept_rows selects them
    plan = packing.packed_path(usable, args.max_length)
    if args.mode == "packed" and not args.keep_plan:
        plan.unlink(missing_ok=True)
    gc.collect()
    opened = memory()
    peaks = Peaks()
    counting = pa.proxy_memory_pool(pa.default_memory_pool())
    pa.set_memory_pool(counting)
    tracemalloc.start()
    started = time.perf_counter()
    train_set, fill = packing.pack(usable, args.max_length) if args.mode == "packed" else (usable, None)
    packed = time.perf_counter()
    loader, _ = batches.make_loaders(train_set, [], batches.PadToLongest(0), batch_size=8)
    batch = next(iter(loader))
    done = time.perf_counter()
    allocated = tracemalloc.get_traced_memory()[1] + counting.max_memory()
    tracemalloc.stop()
    peaks.done.set()
    gc.collect()
    after = memory()
    record = {"mode": args.mode, "plan": "read" if args.keep_plan else "computed" if args.mode == "packed" else None,
              "recipes": str(args.recipes), "rows": len(usable), "sequences": len(train_set) if args.mode == "packed" else None,
              "fill": round(fill, 4) if fill is not None else None,
              "plan_bytes": int(train_set.starts.nbytes + train_set.rows.nbytes) if args.mode == "packed" else 0,
              "batch_shape": list(batch["input_ids"].shape),
              "mib": {"opened": {k: round(v / MIB) for k, v in opened.items()},
                      "peak": {k: round(v / MIB) for k, v in peaks.peak.items()},
                      "after": {k: round(v / MIB) for k, v in after.items()}},
              "allocated_peak_mib": round(allocated / MIB, 1),
              "pack_s": round(packed - started, 2), "first_batch_s": round(done - started, 2)}
    print(json.dumps(record))
    sys.stdout.flush()
    os._exit(0)  # Arrow buffers from the counting pool may outlive it: no teardown


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    writing = sub.add_parser("write")
    writing.add_argument("--lengths-from", nargs="+", required=True)
    writing.add_argument("--rows", type=int, required=True)
    writing.add_argument("--out", type=Path, required=True)
    measuring = sub.add_parser("measure")
    measuring.add_argument("--set", type=Path, required=True)
    measuring.add_argument("--mode", choices=("plain", "packed"), required=True)
    measuring.add_argument("--recipes", type=Path, default=REPO / "recipes")
    measuring.add_argument("--keep-plan", action="store_true")
    measuring.add_argument("--max-length", type=int, default=1024)
    args = parser.parse_args(argv)
    if args.command == "write":
        write(args.lengths_from, args.rows, args.out)
    else:
        measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
