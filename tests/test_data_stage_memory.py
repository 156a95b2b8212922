"""What reading the training rows costs a rank's memory beyond the plan of its work: the rows stay in the
memory-mapped Arrow files, and a pass over them holds a batch of rows at a time, never a column.

Measured in a fresh process on chat rows written here as the recipes' data cache holds them (an Arrow file,
memory-mapped, and a selection over it, as the train split is): Python's allocations (tracemalloc) plus
Arrow's (its memory pool) at their peak while the run's shared system prompt is read (run.json records it).
Counts of allocated bytes, not resident sizes: the same on a busy machine."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from conftest import REPO

ROWS = 40_000
USER_CHARS, REPLY_CHARS = 3_000, 1_000

MEASURE = r"""
import gc, json, os, sys, tracemalloc
sys.path.insert(0, sys.argv[1])
import datasets, numpy as np, pyarrow as pa
from common.data import preparation

datasets.disable_progress_bars()
rows = datasets.Dataset.from_file(sys.argv[2])  # memory-mapped, as the data cache is
split = rows.select(np.random.default_rng(0).permutation(len(rows)))  # a selection, as the train split is
DEFAULT_POOL = pa.default_memory_pool()
arrow = pa.proxy_memory_pool(DEFAULT_POOL)  # counts what Arrow allocates meanwhile
pa.set_memory_pool(arrow)
gc.collect()
tracemalloc.start()
texts = preparation.opening_system_prompts(split)
python_peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
print(json.dumps({"peak": python_peak + arrow.max_memory(), "texts": sorted(texts)}))
sys.stdout.flush()
os._exit(0)  # Arrow buffers from the counting pool may outlive it: no teardown
"""


def write_chats(path, rows: int) -> int:
    """`rows` conversations (a shared system turn, a long user turn, a reply) in an Arrow stream file, as
    `datasets` caches them; returns the bytes of their text."""
    import pyarrow as pa

    rng = np.random.default_rng(1)
    users = [("question %d " % i) * (USER_CHARS // 12) for i in rng.integers(0, 1000, rows)]
    replies = ["answer " * (REPLY_CHARS // 7)] * rows
    roles = pa.array(["system", "user", "assistant"] * rows)
    contents = pa.array([text for user, reply in zip(users, replies) for text in ("Be brief.", user, reply)])
    turns = pa.StructArray.from_arrays([roles, contents], names=["role", "content"])
    messages = pa.ListArray.from_arrays(pa.array(np.arange(0, 3 * rows + 1, 3, dtype=np.int32)), turns)
    table = pa.table({"messages": messages})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=1_000)
    return contents.nbytes


def test_reading_the_shared_system_prompt_holds_a_batch_not_the_column(tmp_path):
    path = tmp_path / "chats.arrow"
    text_bytes = write_chats(path, ROWS)
    done = subprocess.run([sys.executable, "-c", MEASURE, str(REPO / "recipes"), str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["texts"] == ["Be brief."]
    # the rows' text is ~160 MB; a batch of 1,000 rows is ~4 MB: reading them whole would copy every one
    assert text_bytes > 150 * 2**20
    assert measured["peak"] < 16 * 2**20, measured


def test_the_data_line_is_counted_in_arrow(tmp_path):
    """The data line's counts (rows used, cut, dropped and why, the replies' stop signal) over 200,000 rows:
    Python holds a few objects, not a list of every row's values (~40 MB here, 420 MB at 2,000,000 rows)."""
    import tracemalloc

    import datasets
    import pyarrow as pa

    sys.path.insert(0, str(REPO / "recipes"))
    from common.data import tokens

    rows, rng = 200_000, np.random.default_rng(0)
    every = pa.array(np.zeros(rows, dtype=np.int64))
    table = pa.table({"input_ids": pa.array([[1, 2, 3]]).take(every),
                      "dropped": pa.array(np.where(rng.random(rows) < 0.02, "too long", "")),
                      "needs": pa.array(rng.integers(50, 2000, rows)), "cut": pa.array(rng.random(rows) < 0.01),
                      "eos_added": pa.array(np.zeros(rows, bool)), "stops": pa.array([["</s>"]]).take(every),
                      "boundary": pa.array(np.zeros(rows, bool))})
    path = tmp_path / "tokenised.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=1_000)
    tokenised = datasets.Dataset.from_file(str(path))
    tracemalloc.start()
    line = tokens.counted(tokenised)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    dropped = int((table["dropped"].to_numpy(zero_copy_only=False) != "").sum())
    cut = int(table["cut"].to_numpy(zero_copy_only=False).sum())
    assert line == (f"200,000 rows: {rows - dropped:,} used ({cut:,} of them cut to --max-length), {dropped:,} dropped "
                    f"(too long: {dropped:,}); replies end with </s>")
    assert peak < 2**20, peak
    assert len(tokens.kept_rows(tokenised)) == rows - dropped
