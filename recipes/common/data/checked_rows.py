"""Files -> checked rows: each --dataset source's rows as read (data_files.py), their format found (rows
of a second format, or a column the format reads that holds no text, refused on every rank), and the
evaluation rows set apart."""

from __future__ import annotations

from dataclasses import dataclass

from ..refusal import refuse
from .data_files import EVAL_SPLIT_NAMES, read_splits
from .images import as_read
from .formats import (
    FORMAT_KEYS,
    READ_COLUMNS,
    TEXT_COLUMNS,
    detect_format,
    feature_name,
    filled_columns,
    first_row_lacking,
    row_problem,
)
from .mixture import Source, sources_of


@dataclass
class SourceRows:
    """One source's rows of one split, with its format."""

    name: str  # the dataset as read (the bundled data/ as a path)
    fmt: str
    rows: "datasets.Dataset"  # noqa: F821 (datasets is imported where it is used)
    source: Source


def load_sources(given, seed: int, columns: str | None = None, eval_spec: str | None = None, found_format=None,
                 problem=None):
    """(training rows, evaluation rows), each a list of SourceRows: one per --dataset source, read
    and checked on every rank. A source's evaluation rows are its eval / validation / test split, else
    a share of its rows held out (before its weight draws from the rest, so a changed weight never
    moves a row between training and evaluation); `eval_spec` (--eval-dataset) replaces them all, and
    every source's rows then train.

    `columns` renames every source's columns to the ones a format expects, e.g.
    "instruction=question,response=answer". `found_format(rows, name)` finds (and checks) a source's format and
    `problem(row, fmt)` says why a row cannot train: the supervised rows' by default; pairs.py's for preference
    pairs, feedback.py's for judged replies.
    """
    found_format, problem = found_format or format_of, problem or row_problem
    train, evaluation = [], []
    for source in sources_of(given):
        loaded, name = read_splits(source.spec, columns)
        loaded = as_read(loaded)  # rows with images: undecoded, each numbered in its file (images.py)
        rows = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
        fmt = found_format(rows, name)  # no known columns, or rows of two formats: refused here, on every rank
        eval_name = next((split for split in EVAL_SPLIT_NAMES if split in loaded), None)
        if eval_spec:
            held = None
        elif eval_name is not None:
            held = loaded[eval_name]
        else:
            rows, held = held_out(rows, fmt, name, seed, problem)
        train.append(SourceRows(name, fmt, rows, source))
        if held is not None:
            evaluation.append(SourceRows(name, fmt, held, source))
    if eval_spec:
        loaded, name = read_splits(eval_spec, columns)
        loaded = as_read(loaded)
        split = next((split for split in EVAL_SPLIT_NAMES if split in loaded),
                     "train" if "train" in loaded else next(iter(loaded)))
        fmt = found_format(loaded[split], name)
        trained = sorted({part.fmt for part in train})
        if fmt not in trained:
            trains = f"--dataset {train[0].name}" if len(train) == 1 else "the --dataset sources"
            refuse(f"--eval-dataset {name} holds {fmt} rows, {trains} {' and '.join(trained)} rows; give both in one "
                   "format (map columns with --columns)")
        evaluation.append(SourceRows(name, fmt, loaded[split], Source(eval_spec)))
    return train, evaluation


def load_splits(spec: str | None, seed: int, columns: str | None = None, eval_spec: str | None = None):
    """(train, eval) `datasets.Dataset`s of one dataset (a hub id, a folder, or a file): load_sources
    for a single source."""
    train, evaluation = load_sources(spec, seed, columns, eval_spec)
    if len(train) > 1:
        refuse("this tool reads one --dataset; give one (a mixture of several trains in the recipes)")
    return train[0].rows, evaluation[0].rows


def held_out_count(rows: int) -> int:
    """How many of a source's `rows` are held out for evaluation when it has no evaluation split: 5%, 1 to 256."""
    return max(1, min(256, rows // 20))


def held_out(train, fmt: str, name: str, seed: int, problem=row_problem):
    """(training rows, evaluation rows): 5% of the rows (1 to 256) held out, chosen by the seed among
    the rows that can train (`problem(row, fmt)`: why one cannot)."""
    if len(train) < 2:
        refuse(f"--dataset {name} has {len(train)} rows; it needs at least 2 (some are held out for evaluation)")
    held = held_out_count(len(train))
    split = train.train_test_split(test_size=held, seed=seed)
    if all(problem(row, fmt) is None for row in split["test"]):
        return split["train"], split["test"]
    # Hold out rows that can train instead: an unusable row there could leave evaluation empty while
    # training has rows (it stays in training, where it is dropped and counted).
    good = [i for i, row in enumerate(train) if problem(row, fmt) is None]
    if len(good) <= held:
        return split["train"], split["test"]  # too few good rows: the tokenised counts name the problem
    import datasets

    split = train.select(good).train_test_split(test_size=held, seed=seed)
    bad = train.select(sorted(set(range(len(train))) - set(good)))
    return datasets.concatenate_datasets([split["train"], bad]), split["test"]


def format_of(train, spec: str) -> str:
    """The rows' format, from the columns that hold something (a row of JSON Lines that lacks a column
    gets null there). Rows of a second format are refused, naming the first one: dropping them would
    quietly lose part of the data. A column the format reads must hold text."""
    from datasets import Value

    filled = filled_columns(train)
    if train._indices is not None:  # a selection of a table's rows (rare here: files load whole)
        train = train.flatten_indices()
    table = train.data
    fmt = detect_format(filled)
    key = FORMAT_KEYS[fmt]
    others = [other for other in FORMAT_KEYS.values() if other != key and other in filled]
    if others and table.column(key).null_count:
        for other in others:
            row = first_row_lacking(table, key, other)
            if row >= 0:
                refuse(f"--dataset {spec} mixes formats: its rows are `{key}` rows ({fmt}), but row {row + 1} has "
                       f"`{other}` and no `{key}`; keep one format per dataset (convert or remove those rows)")
    for name in READ_COLUMNS[fmt]:
        feature = train.features.get(name)
        if name in TEXT_COLUMNS and feature is not None and not (
                isinstance(feature, Value) and feature.dtype in ("string", "large_string", "null")):
            refuse(f"--dataset {spec}: column `{name}` holds {feature_name(feature)}, not text; store it as text "
                   "(or map another column onto it with --columns)")
    return fmt
