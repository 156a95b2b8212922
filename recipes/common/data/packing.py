"""Packing: tokenised rows -> sequences of up to --max-length tokens, each row whole.

Best-fit decreasing: the longest rows first, each into the fullest sequence it still fits, so
sequences come out fuller than packing rows in file order. The plan is computed on the rows' lengths
alone and saved as two integer arrays; a sequence's tokens are read from the tokenised set when a
batch needs them (`PackedSequences`), so packing costs memory for the row count, not the tokens.
"""

from __future__ import annotations

import bisect

import numpy as np


def best_fit(lengths: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Row indices of each sequence: best-fit decreasing over `lengths` (each <= capacity)."""
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    # room -> the sequences with that much room left; `rooms` holds the keys with a sequence, sorted
    by_room: dict[int, list[int]] = {}
    rooms: list[int] = []
    for row in order.tolist():
        length = int(lengths[row])
        at = bisect.bisect_left(rooms, length)
        if at < len(rooms):  # the fullest sequence with room enough
            room = rooms[at]
            sequence = by_room[room].pop()
            if not by_room[room]:
                del by_room[room]
                rooms.pop(at)
        else:
            room, sequence = capacity, len(bins)
            bins.append([])
        bins[sequence].append(row)
        left = room - length
        if left > 0:
            if left not in by_room:
                by_room[left] = []
                bisect.insort(rooms, left)
            by_room[left].append(sequence)
    return [np.asarray(rows, dtype=np.int64) for rows in bins]


def row_lengths(tokenized) -> np.ndarray:
    """Each row's token count, read from the Arrow column (no Python list per row)."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(tokenized.data.column("input_ids"))
    if tokenized._indices is not None:  # a selection (the usable rows) over the table: its rows only
        lengths = lengths.take(tokenized._indices.column(0))
    return lengths.to_numpy(zero_copy_only=False).astype(np.int64)


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
    path = packed_path(tokenized, max_length)
    if not path.exists():
        bins = best_fit(lengths, max_length)
        starts = np.cumsum([0] + [len(rows) for rows in bins], dtype=np.int64)
        rows = np.concatenate(bins) if bins else np.zeros(0, dtype=np.int64)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        with open(partial, "wb") as sink:
            np.savez(sink, starts=starts, rows=rows)
        os.replace(partial, path)  # whole or absent: a crash leaves no half-written plan to reuse
    with np.load(path) as plan:
        packed = PackedSequences(tokenized, plan["starts"], plan["rows"])
    return packed, float(lengths.sum()) / (len(packed) * max_length) if len(packed) else 0.0
