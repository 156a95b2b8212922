"""Checked rows -> tokens and labels, the prompt masked: every row tokenised (in one batched call of the
tokenizer per 512 rows, over every core for a large set), and counted for the data line: rows that
cannot train are dropped with their reason, and none left is a refusal naming what to change.

How a row of each format becomes text lives in formats.py; where its targets are, in targets.py.
"""

from __future__ import annotations

import os

import numpy as np

from ..refusal import refuse
from .formats import IGNORE, detect_format, filled_columns
from .targets import NO_TOKENS, tokenize_row, tokenize_rows  # noqa: F401 (tokenize_row: one row, for scripts and tests)

REPORT_COLUMNS = ["dropped", "needs", "cut", "eos_added", "stops", "boundary"]  # what the data line counts


def counted(tokenized) -> str:
    """`1,000 rows: 960 used (12 of them cut to --max-length), 40 dropped (too long: 30, empty target: 10)`,
    then the stop signal replies end with and any prompt/target boundary inside a token."""
    from collections import Counter

    tokenized = report_columns(tokenized)
    rows = len(tokenized["dropped"])
    reasons = Counter(reason for reason in tokenized["dropped"] if reason)
    dropped = sum(reasons.values())
    line = f"{rows:,} rows: {rows - dropped:,} used"
    cut = sum(tokenized["cut"])
    if cut:
        line += f" ({cut:,} of them cut to --max-length)"
    if dropped:
        line += f", {dropped:,} dropped ({', '.join(f'{why}: {n:,}' for why, n in reasons.most_common())})"
    added = sum(tokenized["eos_added"])
    stops = Counter(stop for row_stops in tokenized["stops"] for stop in row_stops)
    if added:
        line += f"; EOS added after {added:,} replies (the chat template ends them with no special token)"
    elif stops:
        line += f"; replies end with {' / '.join(stop for stop, _ in stops.most_common(2))}"
    boundary = sum(tokenized["boundary"])
    if boundary:
        line += (f"; in {boundary:,} rows one token holds the prompt's end and the target's start "
                 "(trained as target, as the whole text tokenises)")
    return line


def usable(tokenized, split: str, args, source: str = ""):
    """The rows that can train; none at all is a refusal that names what to change for each cause found
    (and the source, in a mixture of several)."""
    kept = kept_rows(tokenized)
    if len(kept):
        return kept
    refuse(f"no {split} row{f' of {source}' if source else ''} can be used: {counted(tokenized)}; "
           f"{'; '.join(fixes(tokenized))}")


def fixes(tokenized) -> list[str]:
    """What to change, one entry per kind of cause among the dropped rows, the commonest first."""
    from collections import Counter

    tokenized = report_columns(tokenized)
    kinds = Counter()
    for why in tokenized["dropped"]:
        if why:
            kinds["length" if why.startswith("too long") else "template" if why.startswith("the chat template")
                  else "rows"] += 1
    too_long = [needs for needs, why in zip(tokenized["needs"], tokenized["dropped"]) if why.startswith("too long")]
    fix = {"length": f"pass --max-length {min(too_long or [0])} or more (the shortest row needs that many tokens)",
           "template": "the chat template cannot render these rows: pass --chat-template FILE with one that can "
                       "(or drop the turns it refuses)",
           "rows": "fix the rows, or map your columns with --columns"}
    return [fix[kind] for kind, _ in kinds.most_common()]


def kept_rows(tokenized):
    """The rows that can train, without the columns the data line counts."""
    import numpy as np

    dropped = tokenized.select_columns(["dropped"])[:]["dropped"]
    # an array, not a list: datasets hashes the indices for the cache key, a list of 200,000 ints slowly
    kept = np.array([i for i, why in enumerate(dropped) if not why], dtype=np.int64)
    return tokenized.select(kept).remove_columns(REPORT_COLUMNS)


def report_columns(tokenized) -> dict:
    """{column: list of values} of the columns the data line counts, read in one go: a column read row
    by row (datasets 5's lazy columns) costs seconds at 200,000 rows."""
    return tokenized.select_columns(REPORT_COLUMNS)[:]


ROWS_PER_PROCESS = 10_000  # about this many rows a process: below, a process of its own costs more than it saves


def preparing_processes(rows: int) -> int | None:
    """Processes that tokenise a large set together (every core of the machine: the other ranks only
    wait meanwhile); None, the calling process alone, for a small one."""
    processes = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                    round(rows / ROWS_PER_PROCESS))
    return processes if processes > 1 else None


def data_path_code() -> str:
    """A hash of the modules that turn rows into tokens and targets."""
    import hashlib
    from pathlib import Path

    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in ("formats.py", "targets.py", "tokens.py")))\
        .hexdigest()[:16]


def tokenize_counted(dataset, tokenizer, max_length: int):
    """(every row tokenised, format name). Each row also gets `dropped`: why it cannot train ("" when
    it can), `needs`: the --max-length that keeps one of its targets, `cut`: whether it trains on its
    first `max_length` tokens only (the rest of its targets are lost), and what the data line reports
    (`eos_added`, `stops`, `boundary`: see targets.tokenize_rows)."""
    fmt = detect_format(filled_columns(dataset))

    def batch_of_rows(columns: dict, code: str) -> dict:  # `code` only keys datasets' cache (see below)
        rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
        out = {key: [] for key in ["input_ids", "labels", *REPORT_COLUMNS]}
        for row in tokenize_rows(rows, tokenizer, fmt):
            labels = row["labels"]
            # The label of token i is predicted from token i - 1: the first target at i needs i + 1 tokens.
            targets = np.flatnonzero(labels[1:] != IGNORE)
            needs = int(targets[0]) + 2 if len(targets) else 0
            # A row whose targets were all cut off by --max-length teaches nothing.
            dropped = row["problem"] or (f"too long for --max-length {max_length}" if needs > max_length else "")
            keep = not dropped
            out["input_ids"].append(row["input_ids"][:max_length] if keep else NO_TOKENS)
            out["labels"].append(labels[:max_length] if keep else NO_TOKENS)
            out["dropped"].append(dropped)
            out["needs"].append(needs)
            out["cut"].append(keep and len(row["input_ids"]) > max_length)
            for key in ("eos_added", "stops", "boundary"):
                out[key].append(row[key] if keep else type(row[key])())
        return out

    # datasets keys its cache by the rows, this function and its arguments (the tokenizer and its template
    # included), but not by the code this function calls: the hash of that code is an argument too, so a
    # changed data path never reuses rows tokenised by an older one
    processes = preparing_processes(len(dataset))
    threads = os.environ.get("TOKENIZERS_PARALLELISM")
    if processes:  # the work is split over processes: the tokenizer's own threads would only compete (and warn)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        tokenized = dataset.map(batch_of_rows, batched=True, batch_size=512, remove_columns=dataset.column_names,
                                fn_kwargs={"code": data_path_code()}, num_proc=processes, desc="tokenising",
                                features=tokenised_features())
    finally:  # a smaller set tokenised next (the evaluation rows) has the tokenizer's threads again
        if threads is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = threads
    return tokenized, fmt


def tokenised_features():
    """Token ids and labels as int32: half the cache (and the pages every rank maps) of datasets' int64."""
    from datasets import Features, List, Value

    return Features({"input_ids": List(Value("int32")), "labels": List(Value("int32")), "dropped": Value("string"),
                     "needs": Value("int64"), "cut": Value("bool"), "eos_added": Value("int64"),
                     "stops": List(Value("string")), "boundary": Value("bool")})
