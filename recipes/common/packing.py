"""Packing: tokenised rows -> sequences of up to --max-length tokens, each row whole.

Best-fit decreasing: the longest rows first, each into the fullest sequence it still fits, so
sequences come out fuller than packing rows in file order. Everything is computed on arrays (the
rows' lengths, then each sequence a slice of the gathered token arrays) and written chunk by chunk
into an Arrow file that every rank memory-maps, so memory stays bounded whatever the row count.
"""

from __future__ import annotations

import bisect

import numpy as np

CHUNK_ROWS = 8_000  # rows gathered at a time while writing the packed sequences


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


def _packed_tables(tokenized, bins: list[np.ndarray]):
    """The packed sequences as Arrow tables of a few thousand sequences each: input_ids, labels and
    position_ids (restarting at every row), int32."""
    import pyarrow as pa

    start = 0
    while start < len(bins):
        chunk, rows = [], 0
        while start < len(bins) and (not chunk or rows + len(bins[start]) <= CHUNK_ROWS):
            chunk.append(bins[start])
            rows += len(bins[start])
            start += 1
        gathered = tokenized.with_format("arrow", columns=["input_ids", "labels"])[np.concatenate(chunk).tolist()]
        lists = {name: gathered.column(name).combine_chunks() for name in ("input_ids", "labels")}
        columns = {name: values.flatten().to_numpy(zero_copy_only=False).astype(np.int32) for name, values in lists.items()}
        row_offsets = lists["input_ids"].offsets.to_numpy() - lists["input_ids"].offsets[0].as_py()  # labels: the same
        # a row's tokens are consecutive in the gathered rows, and so are a sequence's rows
        ends_of_sequences = np.cumsum([len(rows_of_sequence) for rows_of_sequence in chunk])
        sequence_offsets = np.concatenate([[0], row_offsets[ends_of_sequences]]).astype(np.int32)
        row_lengths_here = np.diff(row_offsets)
        columns["position_ids"] = (np.arange(row_offsets[-1]) - np.repeat(row_offsets[:-1], row_lengths_here)).astype(np.int32)
        yield pa.table({name: pa.ListArray.from_arrays(pa.array(sequence_offsets), pa.array(values))
                        for name, values in columns.items()})


def packed_path(tokenized, max_length: int):
    """Where the packed set of `tokenized` is written: beside its cache files (in the system's temporary
    folder for a set held in memory), named by its fingerprint, `max_length` and this module's code."""
    import hashlib
    import tempfile
    from pathlib import Path

    cached = tokenized.cache_files
    folder = Path(cached[0]["filename"]).parent if cached else Path(tempfile.gettempdir()) / "recipes-packed"
    folder.mkdir(parents=True, exist_ok=True)
    layout = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:8]  # a changed packing never reuses a file
    return folder / f"packed-{tokenized._fingerprint}-{max_length}-{layout}.arrow"


def pack(tokenized, max_length: int):
    """(packed dataset, fill ratio): the rows of `tokenized` packed into sequences of up to `max_length`
    tokens, whose `position_ids` restart at 0 for every row.

    transformers reads such position_ids as packed sequences and keeps attention inside each row
    (sdpa / eager build a block-diagonal causal mask, flash-attention uses the varlen kernel). A row's
    first label is its masked BOS or prompt, so no target crosses a boundary.

    The packed set is an Arrow file (`packed_path`): a rerun, and the other ranks, map the file that is
    there.
    """
    import os

    import datasets
    import pyarrow as pa

    lengths = row_lengths(tokenized)
    path = packed_path(tokenized, max_length)
    if not path.exists():
        bins = best_fit(lengths, max_length)
        schema = pa.schema({name: pa.list_(pa.int32()) for name in ("input_ids", "labels", "position_ids")})
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        with pa.OSFile(str(partial), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for table in _packed_tables(tokenized, bins):
                writer.write_table(table)
        os.replace(partial, path)  # whole or absent: a crash leaves no half-written set to reuse
    packed = datasets.Dataset.from_file(str(path))
    return packed, float(lengths.sum()) / (len(packed) * max_length) if len(packed) else 0.0
