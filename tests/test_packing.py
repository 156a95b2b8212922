"""Best-fit packing on arrays: every row once and whole, sequences within --max-length and fuller than
packing in file order, position_ids restarting at every row."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
from common.data import batches, packing  # noqa: E402


def in_file_order(lengths, capacity: int) -> int:
    """How many sequences greedy packing in file order needs (what the recipes did before)."""
    sequences, used = 0, capacity
    for length in lengths:
        if used + length > capacity:
            sequences, used = sequences + 1, 0
        used += length
    return sequences


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_keeps_every_row_once_within_capacity_and_fills_better(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 700, size=3000)
    lengths[:50] = 1024  # rows of exactly --max-length are sequences of their own
    bins = packing.best_fit(lengths, 1024)
    rows = np.concatenate(bins)
    assert sorted(rows.tolist()) == list(range(len(lengths)))
    assert max(lengths[b].sum() for b in bins) <= 1024
    assert len(bins) < in_file_order(lengths, 1024)
    assert lengths.sum() / (len(bins) * 1024) > 0.97


def test_packed_sequences_are_the_rows_whole_with_positions_restarting():
    import datasets

    rng = np.random.default_rng(1)
    rows = [{"input_ids": rng.integers(4, 300, size=n).tolist(), "labels": [-100] + rng.integers(4, 300, size=n - 1).tolist()}
            for n in rng.integers(2, 60, size=400)]
    dropped = [{"input_ids": [1] * 100, "labels": [1] * 100}] * 50  # rows the recipes drop before packing
    kept = datasets.Dataset.from_list(dropped + rows).select(range(len(dropped), len(dropped) + len(rows)))
    packed, fill = packing.pack(kept, 128)
    pieces = []
    for sequence in packed:
        assert len(sequence["input_ids"]) == len(sequence["labels"]) == len(sequence["position_ids"]) <= 128
        starts = [i for i, position in enumerate(sequence["position_ids"]) if position == 0] + [len(sequence["input_ids"])]
        for a, b in zip(starts, starts[1:]):
            assert sequence["position_ids"][a:b] == list(range(b - a))
            pieces.append((tuple(sequence["input_ids"][a:b]), tuple(sequence["labels"][a:b])))
    assert sorted(pieces) == sorted((tuple(row["input_ids"]), tuple(row["labels"])) for row in rows)
    assert fill == pytest.approx(sum(len(row["input_ids"]) for row in rows) / (len(packed) * 128))
    assert packed.tokens.features["input_ids"].feature.dtype == "int32"  # read from the tokenised set as it is


def test_an_empty_training_set_packs_to_nothing():
    import datasets

    empty = datasets.Dataset.from_dict({"input_ids": [[1]], "labels": [[1]]}).select([])
    packed, fill = packing.pack(empty, 64)
    assert len(packed) == 0 and fill == 0.0


def test_the_packed_batches_mask_padding_as_rows_of_their_own():
    import datasets

    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 9]}]
    packed, _ = packing.pack(datasets.Dataset.from_list(rows * 3), 5)
    batch = batches.PadToLongest(0)([packed[i] for i in range(len(packed))])
    assert batch["input_ids"].shape[1] == 5 and "attention_mask" not in batch
    assert int((batch["labels"] != -100).sum()) == 3 * 3


def test_a_packing_plan_is_saved_once_and_read_again(tmp_path):
    """The packing plan is a file named by the tokenised set, --max-length and the packing code: the same
    inputs read the same file (a rerun, the other ranks), other inputs get their own."""
    import datasets

    source = tmp_path / "rows.jsonl"
    source.write_text("".join(f'{{"input_ids": {list(range(2, 2 + n))}, "labels": {list(range(2, 2 + n))}}}\n'
                              for n in range(2, 40)))
    rows = datasets.load_dataset("json", data_files=str(source), split="train", cache_dir=str(tmp_path / "cache"))
    first, _ = packing.pack(rows, 64)
    path = packing.packed_path(rows, 64)
    assert tmp_path / "cache" in path.parents  # beside the tokenised set's cache
    written = path.stat().st_mtime_ns
    again, _ = packing.pack(rows, 64)
    assert path.stat().st_mtime_ns == written and again["input_ids"] == first["input_ids"]
    assert packing.packed_path(rows, 32) != path
    with np.load(path) as plan:  # which rows go where, no token: packing holds the row count, not the tokens
        assert sorted(plan.files) == ["rows", "starts"] and len(plan["rows"]) == len(rows)
    assert not list(path.parent.glob("*.partial"))


def test_the_packed_set_feeds_the_loader_worker_processes_a_gpu_run_uses():
    """On a GPU the DataLoader's worker processes read the packed set (it travels to them pickled):
    every target of every row arrives, in micro-batches within --max-length."""
    import datasets

    rng = np.random.default_rng(2)
    rows = [{"input_ids": rng.integers(4, 300, size=n).tolist(), "labels": [-100] + rng.integers(4, 300, size=n - 1).tolist()}
            for n in rng.integers(2, 40, size=300)]
    packed, _ = packing.pack(datasets.Dataset.from_list(rows), 96)
    train_loader, _ = batches.make_loaders(packed, [], batches.PadToLongest(0), batch_size=4, workers=2)
    seen = list(train_loader)
    assert max(batch["input_ids"].shape[1] for batch in seen) <= 96
    assert sum(len(batch["input_ids"]) for batch in seen) == len(packed) // 4 * 4  # the ragged last batch dropped
    everything = batches.PadToLongest(0)(packed.__getitems__(range(len(packed))))
    assert int((everything["labels"] != -100).sum()) == sum(len(row["labels"]) - 1 for row in rows)
