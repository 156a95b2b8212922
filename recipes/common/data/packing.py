"""Packing: tokenised rows -> sequences of up to --max-length tokens, each row whole.

Best-fit decreasing: the longest rows first, each into the fullest sequence it still fits, so
sequences come out fuller than packing rows in file order. The plan is computed on the rows' lengths
(read from Arrow's offsets) and saved as two int64 arrays; a sequence's tokens are read from the
tokenised set's memory-mapped files when a batch needs them (`PackedSequences`).

What a rank holds for packing is the plan: 8 bytes a row and 8 a sequence (~10 bytes a row at
--max-length 1024), plus ~30 bytes a row for a moment on the rank that computes it; never a token.
A packed run does need more memory in its steps: each micro-batch is --batch-size sequences of up to
--max-length tokens (nearly full), where an unpacked one is --batch-size rows padded to the longest
(results/2026-11-27_cpu_packing-memory).
"""

from __future__ import annotations

import bisect
from array import array

import numpy as np


def best_fit(lengths: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Row indices of each sequence: best-fit decreasing over `lengths` (each <= capacity)."""
    starts, rows = best_fit_plan(lengths, capacity)
    return np.split(rows, starts[1:-1]) if len(rows) else []


PLAN_CHUNK = 4096  # rows placed per pass of the loop: its Python objects stay this many, whatever the set's size


def best_fit_plan(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, rows): best-fit decreasing over `lengths` (each <= capacity), the longest rows first, each
    into the fullest sequence it still fits. Sequence i is rows[starts[i]:starts[i + 1]], in the order its
    rows were placed.

    Held meanwhile: a few arrays of a row's size (~28 bytes a row with `lengths`), and no Python object per
    row or per sequence (a list per sequence held ~130 bytes a row at its peak)."""
    lengths = np.asarray(lengths)
    order = np.argsort(-lengths, kind="stable")
    sequence_of = np.empty(len(order), dtype=np.int32 if len(order) < 2**31 else np.int64)  # of order[i]
    # room -> the sequences with that much room left (the last placed on top); `rooms`: its keys, sorted
    by_room: dict[int, array] = {}
    rooms: list[int] = []
    sequences = 0
    for first in range(0, len(order), PLAN_CHUNK):
        placed = []
        for length in lengths[order[first:first + PLAN_CHUNK]].tolist():
            at = bisect.bisect_left(rooms, length)
            if at < len(rooms):  # the fullest sequence with room enough
                room = rooms[at]
                sequence = by_room[room].pop()
                if not by_room[room]:
                    del by_room[room]
                    rooms.pop(at)
            else:
                room, sequence = capacity, sequences
                sequences += 1
            placed.append(sequence)
            left = room - length
            if left > 0:
                if left not in by_room:
                    by_room[left] = array("q")
                    bisect.insort(rooms, left)
                by_room[left].append(sequence)
        sequence_of[first:first + len(placed)] = placed
    starts = np.zeros(sequences + 1, dtype=np.int64)
    np.cumsum(np.bincount(sequence_of, minlength=sequences), out=starts[1:])
    # each sequence's rows together, in the order they were placed (a stable sort keeps it)
    rows = np.argsort(sequence_of, kind="stable")
    del sequence_of
    for first in range(0, len(rows), PLAN_CHUNK):  # positions in `order` -> rows, in place
        rows[first:first + PLAN_CHUNK] = order[rows[first:first + PLAN_CHUNK]]
    return starts, rows


def row_lengths(tokenized) -> np.ndarray:
    """Each row's token count, read from the Arrow column (no Python list per row)."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(tokenized.data.column("input_ids"))
    if tokenized._indices is not None:  # a selection (the usable rows) over the table: its rows only
        lengths = lengths.take(tokenized._indices.column(0))
    return lengths.to_numpy(zero_copy_only=False)  # the offsets' int32, not an int64 copy


class PackedSequences:
    """The packed training set: sequence i is rows `rows[starts[i]:starts[i + 1]]` of the tokenised set,
    end to end, with position_ids restarting at 0 for every row.

    Only the plan (which rows go where: two integer arrays) is held; a sequence's tokens are read from
    the tokenised set's memory-mapped files when a batch asks for it. So packing touches no token, writes
    nothing but the plan, and memory stays bounded by the rows' count whatever their length.
    """

    def __init__(self, tokenized, starts: np.ndarray, rows: np.ndarray):
        self.tokens = tokenized.with_format("arrow", columns=["input_ids", "labels"])
        self.starts, self.rows = starts, rows

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, index):
        if isinstance(index, str):  # a column, as a dataset gives it
            return [sequence[index] for sequence in self]
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.__getitems__([index])[0]

    def __iter__(self):
        for first in range(0, len(self), 256):
            yield from self.__getitems__(range(first, min(first + 256, len(self))))

    def __getitems__(self, indices) -> list[dict]:
        """The sequences at `indices`, their rows read in one gather (the DataLoader asks per micro-batch)."""
        parts = [self.rows[self.starts[index]:self.starts[index + 1]] for index in indices]
        if not parts:
            return []
        gathered = self.tokens[np.concatenate(parts).tolist()]
        lists = {name: gathered.column(name).combine_chunks() for name in ("input_ids", "labels")}
        flat = {name: values.flatten().to_numpy(zero_copy_only=False) for name, values in lists.items()}
        row_offsets = lists["input_ids"].offsets.to_numpy() - lists["input_ids"].offsets[0].as_py()  # labels: the same
        flat["position_ids"] = np.arange(row_offsets[-1]) - np.repeat(row_offsets[:-1], np.diff(row_offsets))
        # a sequence's rows are consecutive in the gathered rows
        bounds = row_offsets[np.cumsum([0] + [len(part) for part in parts])]
        return [{name: values[start:end].tolist() for name, values in flat.items()}
                for start, end in zip(bounds[:-1], bounds[1:])]


def packed_path(tokenized, max_length: int):
    """Where the packing plan of `tokenized` is saved: beside its cache files (in the system's temporary
    folder for a set held in memory), named by its fingerprint, `max_length` and this module's code."""
    import hashlib
    import tempfile
    from pathlib import Path

    cached = tokenized.cache_files
    folder = Path(cached[0]["filename"]).parent if cached else Path(tempfile.gettempdir()) / "recipes-packed"
    folder.mkdir(parents=True, exist_ok=True)
    layout = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:8]  # a changed packing never reuses a plan
    return folder / f"packed-{tokenized._fingerprint}-{max_length}-{layout}.npz"


def pack(tokenized, max_length: int):
    """(packed set, fill ratio): the rows of `tokenized` packed into sequences of up to `max_length`
    tokens, whose `position_ids` restart at 0 for every row.

    transformers reads such position_ids as packed sequences and keeps attention inside each row
    (sdpa / eager build a block-diagonal causal mask, flash-attention uses the varlen kernel). A row's
    first label is its masked BOS or prompt, so no target crosses a boundary.

    The plan is saved (`packed_path`): a rerun, and the other ranks, read the one that is there.
    """
    import os

    lengths = row_lengths(tokenized)
    tokens = int(lengths.sum(dtype=np.int64))
    path = packed_path(tokenized, max_length)
    if path.exists():
        with np.load(path) as plan:
            starts, rows = plan["starts"], plan["rows"]
    else:
        starts, rows = best_fit_plan(lengths, max_length)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        with open(partial, "wb") as sink:
            np.savez(sink, starts=starts, rows=rows)
        os.replace(partial, path)  # whole or absent: a crash leaves no half-written plan to reuse
    del lengths  # the plan is all a rank keeps
    packed = PackedSequences(tokenized, starts, rows)
    return packed, tokens / (len(packed) * max_length) if len(packed) else 0.0
