"""What --packing costs a rank's memory: the plan (a few integers a row), never the tokens.

Measured in a fresh process on tokenised sets written here as the recipes' cache holds them (Arrow files,
memory-mapped, int32 token columns, a selection of the usable rows over them): Python's allocations
(tracemalloc, numpy's arrays included) plus Arrow's (its memory pool) at their peak, while one rank packs
the set and takes its first batch (rank 0: the plan is computed and saved) and while another does (the
saved plan is read). Both are counts of allocated bytes, not resident sizes: the same on a busy machine.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
from common.data import packing  # noqa: E402

MAX_LENGTH = 1024
ROWS = 100_000
BATCH_BYTES = 4 * 2**20  # a micro-batch of 8 x 1,024 tokens: three lists of Python ints and their tensors

# One rank's packing, measured: rank 0 packs (and saves the plan), then the plan is read as another rank
# reads it; each then takes the loader's first batch. Printed: the peak bytes of packing and of the batch
# for each, the plan's size and the sequences.
MEASURE = r"""
import gc, json, os, sys, tracemalloc
sys.path.insert(0, sys.argv[1])
import datasets, numpy as np, pyarrow as pa
from common.data import batches, packing

datasets.disable_progress_bars()
tokenized = datasets.Dataset.from_file(sys.argv[2])  # memory-mapped, as the tokenised cache is
usable = tokenized.select(np.load(sys.argv[3]))  # the rows that can train: a selection, as kept_rows makes it
max_length = int(sys.argv[4])
DEFAULT_POOL = pa.default_memory_pool()
COUNTING_POOLS = []  # kept to the end: buffers allocated from one must never outlive it


def peak_bytes(work):  # (Python's peak + Arrow's peak bytes while `work` runs, what it returned)
    arrow = pa.proxy_memory_pool(DEFAULT_POOL)  # counts what Arrow allocates meanwhile
    COUNTING_POOLS.append(arrow)
    pa.set_memory_pool(arrow)
    gc.collect()
    tracemalloc.start()
    try:
        kept = work()
        python_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(DEFAULT_POOL)
    return python_peak + arrow.max_memory(), kept


measured = {}
for rank in ("computing", "reading"):  # rank 0 computes and saves the plan; the others read it
    measured[f"pack_{rank}"], packed = peak_bytes(lambda: packing.pack(usable, max_length)[0])
    loader, _ = batches.make_loaders(packed, [], batches.PadToLongest(0), batch_size=8)
    measured[f"batch_{rank}"], _ = peak_bytes(lambda: next(iter(loader)))
    measured["plan"] = packed.starts.nbytes + packed.rows.nbytes
    measured["sequences"] = len(packed)
    del packed, loader
print(json.dumps(measured))
sys.stdout.flush()
os._exit(0)  # Arrow buffers from the counting pools may outlive them: no teardown
"""


def write_tokenised(folder, lengths: np.ndarray, seed: int):
    """A tokenised set as the recipes' cache holds it: an Arrow stream file of int32 `input_ids` and
    `labels` (the first token of each row masked), and the usable rows (all but every 50th) to select."""
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    input_ids = rng.integers(4, 32_000, size=int(offsets[-1]), dtype=np.int32)
    labels = input_ids.copy()
    labels[offsets[:-1]] = -100
    table = pa.table({"input_ids": pa.ListArray.from_arrays(offsets, input_ids),
                      "labels": pa.ListArray.from_arrays(offsets, labels)})
    folder.mkdir(parents=True)
    path = folder / "tokenised.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=1000)  # record batches of 1,000 rows, as datasets writes them
    usable = np.flatnonzero(np.arange(len(lengths)) % 50 != 0)
    np.save(folder / "usable.npy", usable)
    return path, folder / "usable.npy"


def measure(path, usable) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(REPO / "recipes"), str(path), str(usable), str(MAX_LENGTH)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def short_and_long(tmp_path_factory):
    """The same 100,000 rows, their tokens ~20 a row and 10x longer (~200: 20 million tokens a column)."""
    root = tmp_path_factory.mktemp("packing-memory")
    short = np.random.default_rng(0).integers(4, 37, size=ROWS)
    measured = {}
    for name, lengths in (("short", short), ("long", short * 10)):
        measured[name] = measure(*write_tokenised(root / name, lengths, seed=1))
        measured[name]["tokens"] = int(lengths.sum())
    return measured


def test_packing_costs_the_same_whatever_the_rows_length(short_and_long):
    """Ten times the tokens, the same rows: packing holds no more than the plan's few integers for the extra
    sequences (longer rows fill a sequence with fewer of them), and a batch no more than its own tokens."""
    short, long = short_and_long["short"], short_and_long["long"]
    extra_sequences = long["sequences"] - short["sequences"]
    for rank in ("computing", "reading"):
        assert long[f"pack_{rank}"] <= short[f"pack_{rank}"] + 4 * 8 * extra_sequences + 256 * 2**10, (rank, short, long)
        assert long[f"batch_{rank}"] <= BATCH_BYTES, (rank, long)
    # a token column read whole would be 80 MB here as int32, ~720 MB as Python ints
    assert long["pack_computing"] < long["tokens"], long


def test_packing_holds_a_few_integers_a_row(short_and_long):
    """Computing the plan holds a few arrays of a row's size for a moment (the lengths, their order, each
    row's sequence, a sort); reading it, the plan (two int64 arrays) and the rows' lengths."""
    for name, measured in short_and_long.items():
        assert measured["pack_computing"] <= 40 * ROWS, (name, measured["pack_computing"] / ROWS, measured)
        assert measured["pack_reading"] <= measured["plan"] + 12 * ROWS + 2**20, (name, measured)


# ------------------------------------------------------------------------------------------------
# The packed sequences themselves: the same as before the plan was made without Python lists

def best_fit_with_lists(lengths, capacity: int) -> list[list[int]]:
    """Best-fit decreasing as written first (a list per sequence): the order the plan must keep."""
    import bisect

    bins, by_room, rooms = [], {}, []
    for row in np.argsort(-np.asarray(lengths), kind="stable").tolist():
        length = int(lengths[row])
        at = bisect.bisect_left(rooms, length)
        if at < len(rooms):
            room = rooms[at]
            sequence = by_room[room].pop()
            if not by_room[room]:
                del by_room[room]
                rooms.pop(at)
        else:
            room, sequence = capacity, len(bins)
            bins.append([])
        bins[sequence].append(row)
        if room - length > 0:
            if room - length not in by_room:
                by_room[room - length] = []
                bisect.insort(rooms, room - length)
            by_room[room - length].append(sequence)
    return bins


@pytest.mark.parametrize("seed", range(4))
def test_the_plan_is_the_one_best_fit_always_made(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 400, size=20_000)
    lengths[rng.integers(0, len(lengths), size=300)] = 512  # rows that fill a sequence alone
    lengths[:1000] = rng.integers(1, 4, size=1000)  # many ties
    expected = best_fit_with_lists(lengths, 512)
    starts, rows = packing.best_fit_plan(lengths, 512)
    assert starts.tolist() == np.cumsum([0] + [len(b) for b in expected]).tolist()
    assert rows.tolist() == [row for b in expected for row in b]
    assert [b.tolist() for b in packing.best_fit(lengths, 512)] == expected


def test_packed_sequences_are_byte_identical_to_before():
    """A seeded set packed as at 9d69d54 (before the plan was built without Python lists): the same
    sequences, rows, tokens and position ids, in the same order (their sha256)."""
    import datasets

    rng = np.random.default_rng(7)
    lengths = np.concatenate([rng.integers(1, 129, size=3000), [128] * 20, rng.integers(1, 40, size=500)])
    rows = [{"input_ids": rng.integers(4, 32000, size=n).tolist(),
             "labels": [-100] + rng.integers(4, 32000, size=n - 1).tolist()} for n in lengths]
    kept = datasets.Dataset.from_list(rows).select([i for i in range(len(rows)) if i % 7])
    packed, fill = packing.pack(kept, 128)
    digest = hashlib.sha256()
    for sequence in packed:
        digest.update(json.dumps(sequence, sort_keys=True).encode())
    assert (len(packed), round(fill, 6)) == (1409, 0.999457)
    assert digest.hexdigest() == "f2220af1b40ec8483234de15b0bb17fd8af694d1e2e5c4a7025ea25f2f9c719c"
