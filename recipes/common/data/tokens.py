"""Checked rows -> tokens and labels, the prompt masked: every row tokenised (in one batched call of the
tokenizer per 512 rows, over every core for a large set), and counted for the data line: rows that
cannot train are dropped with their reason, and none left is a refusal naming what to change.

How a row of each format becomes text lives in formats.py; where its targets are, in targets.py.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pyarrow.compute as pc

from ..refusal import refuse
from .data_files import say_long_wait
from .formats import IGNORE, detect_format, filled_columns, unread_columns
from .images import ROW_NUMBER, image_column
from .mixture import draw, drawn_words, joined, shares
from .targets import NO_TOKENS, tokenize_row, tokenize_rows  # noqa: F401 (tokenize_row: one row, for scripts and tests)

REPORT_COLUMNS = ["dropped", "needs", "cut", "eos_added", "stops", "boundary"]  # what the data line counts


def many(count: int, unit: str) -> str:
    """`1 pair`, `2 pairs`."""
    return f"{count:,} {unit}{'' if count == 1 else 's'}"


# fewer held-out rows than this make eval_loss swing from one evaluation to the next: said at start-up
FEW_EVALUATION_ROWS = 16


def counted(tokenized, unit: str = "row") -> str:
    """`1,000 rows: 960 used (12 of them cut to --max-length), 40 dropped (too long: 30, empty target: 10)`,
    then the stop signal replies end with and any prompt/target boundary inside a token (`unit`: what a
    row is, "pair" for preference pairs)."""
    table = report_columns(tokenized)
    rows = table.num_rows
    reasons = dropped_reasons(table)
    dropped = sum(reasons.values())
    line = f"{many(rows, unit)}: {rows - dropped:,} used"
    cut = trues(table["cut"])
    if cut:
        line += f" ({cut:,} of them cut to --max-length)"
    if dropped:
        line += f", {dropped:,} dropped ({', '.join(f'{why}: {n:,}' for why, n in reasons.most_common())})"
    added = trues(table["eos_added"])
    stops = counts(pc.list_flatten(table["stops"]))
    if added:
        line += f"; EOS added after {added:,} replies (the chat template ends them with no special token)"
    elif stops:
        line += f"; replies end with {' / '.join(stop for stop, _ in stops.most_common(2))}"
    boundary = trues(table["boundary"])
    if boundary:
        line += (f"; in {boundary:,} {unit}s one token holds the prompt's end and the target's start "
                 "(trained as target, as the whole text tokenises)")
    return line


def usable(tokenized, split: str, args, source: str = "", unit: str = "row"):
    """The rows that can train; none at all is a refusal that names what to change for each cause found
    (and the source, in a mixture of several)."""
    kept = kept_rows(tokenized)
    if len(kept):
        return kept
    refuse(f"no {split} {unit}{f' of {source}' if source else ''} can be used: {counted(tokenized, unit)}; "
           f"{'; '.join(fixes(tokenized))}")


def fixes(tokenized) -> list[str]:
    """What to change, one entry per kind of cause among the dropped rows, the commonest first."""
    table = report_columns(tokenized)
    kinds = Counter()
    for why, n in dropped_reasons(table).items():  # (in the order each reason first appears)
        kinds["length" if why.startswith("too long") else "template" if why.startswith("the chat template")
              else "rows"] += n
    shortest = pc.min(pc.filter(table["needs"], pc.starts_with(table["dropped"], "too long"))).as_py()
    fix = {"length": f"pass --max-length {shortest or 0} or more (the shortest row needs that many tokens)",
           "template": "the chat template cannot render these rows: pass --chat-template FILE with one that can "
                       "(or drop the turns it refuses)",
           "rows": "fix the rows, or map your columns with --columns"}
    return [fix[kind] for kind, _ in kinds.most_common()]


def kept_rows(tokenized):
    """The rows that can train, without the columns the data line counts."""
    dropped = tokenized.select_columns(["dropped"]).with_format("arrow")[:]["dropped"]  # "" for a row kept
    # an array, not a list: datasets hashes the indices for the cache key, a list of 200,000 ints slowly
    kept = np.flatnonzero(pc.equal(dropped, "").to_numpy(zero_copy_only=False)).astype(np.int64)
    return tokenized.select(kept).remove_columns(REPORT_COLUMNS)


def report_columns(tokenized):
    """The columns the data line counts, as an Arrow table (a few bytes a row), counted in C: as Python lists
    they cost seconds and hundreds of MB at 2,000,000 rows."""
    return tokenized.select_columns(REPORT_COLUMNS).with_format("arrow")[:]


def dropped_reasons(table):
    """Counter of why rows were dropped ("" for the rows kept), in the order each reason first appears."""
    return counts(pc.filter(table["dropped"], pc.not_equal(table["dropped"], "")))


def counts(values):
    """Counter of an Arrow array's values, in the order each first appears (Counter.most_common keeps it
    among equal counts, as counting row by row did)."""
    return Counter({entry["values"]: entry["counts"] for entry in pc.value_counts(values).to_pylist()})


def trues(column) -> int:
    """How many rows a boolean column marks (a count column: its sum, a pair's two sides)."""
    return pc.sum(column).as_py() or 0


ROWS_PER_PROCESS = 10_000  # about this many rows a process: below, a process of its own costs more than it saves


def preparing_processes(rows: int) -> int | None:
    """Processes that tokenise a large set together (every core of the machine: the other ranks only
    wait meanwhile); None, the calling process alone, for a small one."""
    processes = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                    round(rows / ROWS_PER_PROCESS))
    return processes if processes > 1 else None


def data_path_code(*more: str) -> str:
    """A hash of the modules that turn rows into tokens and targets (and of `more` modules of this package)."""
    import hashlib
    from pathlib import Path

    here = Path(__file__).parent
    names = ("formats.py", "targets.py", "tokens.py", "images.py", *more)
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in names)).hexdigest()[:16]


def tokenize_counted(dataset, tokenizer, max_length: int, images=None):
    """(every row tokenised, format name). Each row also gets `dropped`: why it cannot train ("" when
    it can), `needs`: the --max-length that keeps one of its targets, `cut`: whether it trains on its
    first `max_length` tokens only (the rest of its targets are lost), and what the data line reports
    (`eos_added`, `stops`, `boundary`: see targets.tokenize_rows).

    `images` (a vision-language model's run: an images.ImageRows of the source): each row keeps its rendering
    (`text`) and its images' files (`images`) for the processor, which expands each image's placeholder token as
    it collates; a row is never cut (that could cut through an image), one longer than `max_length` with its
    images' tokens is dropped. A row whose images cannot train is refused, naming it, once the rows are tokenised
    (every rank reads them)."""
    fmt = detect_format(filled_columns(dataset))
    column = image_column(dataset.column_names) if images else None
    if images and fmt != "messages":
        refuse(f"rows with images must be chat rows (`messages`, or TRL's conversational `prompt` / `completion`) "
               f"whose turns place them; these are {fmt} rows (docs/data.md#images)")
    extra = ["text", "images", "image_problem", ROW_NUMBER] if images else []

    def batch_of_rows(columns: dict, code: str) -> dict:  # `code` only keys datasets' cache (see mapped)
        rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
        out = {key: [] for key in ["input_ids", "labels", *REPORT_COLUMNS, *extra]}
        for source, row in zip(rows, tokenize_rows(rows, tokenizer, fmt, images=bool(images))):
            needs = needed_length(row["labels"])
            dropped = dropped_reason(row["problem"], needs, max_length)
            if images:
                files, problem, why, needs = images.fitted(source, column, row["places"], len(row["input_ids"]),
                                                           max_length)
                dropped = row["problem"] or why
                out["text"].append("" if dropped else row["text"])
                out["images"].append([] if dropped else files)
                out["image_problem"].append(problem)
                out[ROW_NUMBER].append(source.get(ROW_NUMBER, 0))
            keep = not dropped
            for key, value in {**kept_tokens(row, max_length if not images else None, keep=keep), "dropped": dropped,
                               "needs": needs}.items():
                out[key].append(value)
        return out

    features = tokenised_features()
    if images:
        from datasets import List, Value

        features.update({"text": Value("string"), "images": List(Value("string")), "image_problem": Value("string"),
                         ROW_NUMBER: Value("int64")})
    tokenised = mapped(dataset, batch_of_rows, features, data_path_code())
    if images:
        images.refuse_problems(tokenised)
    return tokenised, fmt


def needed_length(labels: np.ndarray) -> int:
    """The --max-length that keeps one target: the label of token i is predicted from token i - 1, so the
    first target at i needs i + 1 tokens (0: no target)."""
    targets = np.flatnonzero(labels[1:] != IGNORE)
    return int(targets[0]) + 2 if len(targets) else 0


def dropped_reason(problem: str, needs: int, max_length: int) -> str:
    """Why a row cannot train ("" when it can): its problem, or all its targets cut off by --max-length."""
    return problem or (f"too long for --max-length {max_length}" if needs > max_length else "")


def kept_tokens(row: dict, max_length: int | None, keep: bool) -> dict:
    """A tokenised row (targets.tokenize_rows) cut to `max_length` (None: whole), with what the data line counts
    of it; empty where it is not kept."""
    return {"input_ids": row["input_ids"][:max_length] if keep else NO_TOKENS,
            "labels": row["labels"][:max_length] if keep else NO_TOKENS,
            "cut": keep and max_length is not None and len(row["input_ids"]) > max_length,
            **{key: row[key] if keep else type(row[key])() for key in ("eos_added", "stops", "boundary")}}


def mapped(dataset, batch_function, features, code: str):
    """`batch_function` over the dataset in batches of 512 rows, in every core's process for a large set,
    cached by datasets.

    datasets keys its cache by the rows, the function and its arguments (the tokenizer and its template
    included), but not by the code the function calls: `code`, a hash of that code, is an argument too, so
    a changed data path never reuses rows tokenised by an older one."""
    processes = preparing_processes(len(dataset))
    say_long_wait(len(dataset), f"rows in {processes or 1} process(es)")
    threads = os.environ.get("TOKENIZERS_PARALLELISM")
    if processes:  # the work is split over processes: the tokenizer's own threads would only compete (and warn)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return dataset.map(batch_function, batched=True, batch_size=512, remove_columns=dataset.column_names,
                           fn_kwargs={"code": code}, num_proc=processes, desc="tokenising", features=features)
    finally:  # a smaller set tokenised next (the evaluation rows) has the tokenizer's threads again
        if threads is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = threads


def training_sets(accelerator, args, train_parts, train_tokens, eval_parts, eval_tokens, unit: str = "row"):
    """(train set, eval set): each source's usable rows, drawn by its weight, joined; the data lines and
    the cache's folders printed by the main process."""
    mixed = len(train_parts) > 1
    kept = [usable(tokens, "training", args, part.name if mixed else "", unit)
            for part, tokens in zip(train_parts, train_tokens)]
    drawn = [draw(rows, part.source, position, args.seed) for position, (part, rows) in enumerate(zip(train_parts, kept))]
    evaluation = [usable(tokens, "evaluation", args, part.name if mixed else "", unit)
                  for part, tokens in zip(eval_parts, eval_tokens)]
    train_set, eval_set = joined(drawn), joined(evaluation)
    if accelerator.is_main_process:
        for line in data_lines(train_parts, train_tokens, drawn, eval_parts, eval_tokens, len(eval_set), unit):
            print(line, flush=True)
        if len(eval_set) < FEW_EVALUATION_ROWS:
            print(f"warning: evaluation has {many(len(eval_set), unit)}, too few for eval_loss to mean much from one "
                  f"evaluation to the next; give --eval-dataset, or more rows (5% of them, up to 256, are held out)",
                  flush=True)
        # where a rerun (or a resume) with the same rows, tokenizer and flags reads them: a folder per source
        folders = dict.fromkeys(os.path.dirname(tokens.cache_files[0]["filename"]) for tokens in train_tokens
                                if tokens.cache_files)
        if folders:
            print(f"data cache: {', '.join(folders)}", flush=True)
    return train_set, eval_set


def data_lines(train_parts, train_tokens, drawn, eval_parts, eval_tokens, eval_rows: int, unit: str = "row") -> list[str]:
    """What each source gave: `data (messages): training 1,000 rows: 990 used ...; evaluation ...` for one
    source; a line per source and one for the mixture for several."""
    if len(train_parts) == 1:
        part, rows = train_parts[0], drawn[0]
        drew = f"; {drawn_words(part.source, len(rows))}" if part.source.weight != 1 else ""
        return [f"data ({part.fmt}): training {counted(train_tokens[0], unit)}{drew}; evaluation "
                f"{counted(eval_tokens[0], unit)}{unread_columns(part.rows.column_names, part.fmt)}"]
    held = {id(part.source): tokens for part, tokens in zip(eval_parts, eval_tokens)}
    lines = []
    for part, tokens, rows in zip(train_parts, train_tokens, drawn):
        evaluation = f"; evaluation {counted(held[id(part.source)], unit)}" if id(part.source) in held else ""
        lines.append(f"data: {part.name} ({part.fmt}): training {counted(tokens, unit)}; "
                     f"{drawn_words(part.source, len(rows))}{evaluation}"
                     f"{unread_columns(part.rows.column_names, part.fmt)}")
    trained = {id(part.source) for part in train_parts}
    for part, tokens in zip(eval_parts, eval_tokens):
        if id(part.source) not in trained:  # --eval-dataset
            lines.append(f"data: evaluation {part.name} ({part.fmt}): {counted(tokens, unit)}")
    lines.append(f"data: {len(train_parts)} sources: {many(sum(map(len, drawn)), 'training ' + unit)} "
                 f"({shares([part.name for part in train_parts], list(map(len, drawn)))}), "
                 f"{many(eval_rows, 'evaluation ' + unit)}")
    return lines


def tokenised_features():
    """Token ids and labels as int32: half the cache (and the pages every rank maps) of datasets' int64."""
    from datasets import Features, List, Value

    return Features({"input_ids": List(Value("int32")), "labels": List(Value("int32")), "dropped": Value("string"),
                     "needs": Value("int64"), "cut": Value("bool"), "eos_added": Value("int64"),
                     "stops": List(Value("string")), "boundary": Value("bool")})
