"""Packing: tokenised rows -> sequences of up to --max-length tokens, each row whole.

Best-fit decreasing: the longest rows first, each into the fullest sequence it still fits, so
sequences come out fuller than packing rows in file order. Everything is computed on arrays (the
rows' lengths, then each sequence a slice of the gathered token arrays) and written chunk by chunk
into an Arrow file that every rank memory-maps, so memory stays bounded whatever the row count.
"""

from __future__ import annotations

import bisect

import numpy as np

CHUNK_ROWS = 20_000  # rows gathered at a time while writing the packed sequences


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


def _packed_sequences(tokenized, bins: list[np.ndarray]):
    """Yield each packed sequence (input_ids, labels, position_ids restarting at every row)."""
    import pyarrow as pa

    start = 0
    while start < len(bins):
        chunk, rows = [], 0
        while start < len(bins) and (not chunk or rows + len(bins[start]) <= CHUNK_ROWS):
            chunk.append(bins[start])
            rows += len(bins[start])
            start += 1
        gathered = tokenized.with_format("arrow")[np.concatenate(chunk).tolist()]
        columns = {}
        for name in ("input_ids", "labels"):
            lists = pa.concat_arrays(gathered.column(name).chunks) if gathered.column(name).num_chunks != 1 \
                else gathered.column(name).chunk(0)
            columns[name] = lists.flatten().to_numpy(zero_copy_only=False)
            offsets = lists.offsets.to_numpy()
            offsets = offsets - offsets[0]
        first = 0
        for rows_of_sequence in chunk:
            last = first + len(rows_of_sequence)
            begin, end = offsets[first], offsets[last]
            starts = np.repeat(offsets[first:last], np.diff(offsets[first:last + 1]))
            yield {"input_ids": columns["input_ids"][begin:end], "labels": columns["labels"][begin:end],
                   "position_ids": np.arange(begin, end) - starts}
            first = last


def pack(tokenized, max_length: int):
    """(packed dataset, fill ratio): the rows of `tokenized` packed into sequences of up to `max_length`
    tokens, whose `position_ids` restart at 0 for every row.

    transformers reads such position_ids as packed sequences and keeps attention inside each row
    (sdpa / eager build a block-diagonal causal mask, flash-attention uses the varlen kernel). A row's
    first label is its masked BOS or prompt, so no target crosses a boundary.
    """
    import datasets

    lengths = row_lengths(tokenized)
    bins = best_fit(lengths, max_length)
    features = datasets.Features({name: datasets.Sequence(datasets.Value("int32"))
                                  for name in ("input_ids", "labels", "position_ids")})
    if not bins:
        return datasets.Dataset.from_dict({name: [] for name in features}, features=features), 0.0
    progress = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # the generator's own bars say nothing more than the `packing:` line
    try:
        packed = datasets.Dataset.from_generator(_packed_sequences, features=features,
                                                 gen_kwargs={"tokenized": tokenized, "bins": bins})
    finally:
        if progress:
            datasets.enable_progress_bars()
    fill = float(lengths.sum()) / (len(bins) * max_length) if bins else 0.0
    return packed, fill
