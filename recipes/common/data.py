"""Any supported dataset -> tokenised rows with the prompt masked -> (packed) micro-batches.

Where the rows come from (hub, folder, file) and how they are batched lives here; how a row
of each format becomes tokens and labels lives in formats.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from .formats import IGNORE, TEXT_COLUMNS, RowProblem, detect_format, row_problem, tokenize_row
from .preflight import refuse

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATASET = REPO_ROOT / "data"

FILE_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv", ".tsv": "csv"}
LOADER_OPTIONS = {".tsv": {"delimiter": "\t"}}
# A file's split, from the start of its name (train.jsonl, validation-00000-of-00001.parquet, dev_set.csv).
SPLIT_NAMES = {"train": ("train", "training"), "eval": ("eval", "evaluation"),
               "validation": ("validation", "valid", "val", "dev"), "test": ("test",)}
EVAL_SPLIT_NAMES = ("eval", "validation", "test")


def suffix(path: Path) -> str:
    return path.suffix.lower()


def split_of(file: Path) -> str | None:
    """train / eval / validation / test from the file's name, or None (data of no named split)."""
    import re

    stem = file.name.lower()
    return next((split for split, names in SPLIT_NAMES.items()
                 if any(re.match(rf"{name}(?![a-z])", stem) for name in names)), None)


def prepare(accelerator, tokenizer, args, launch):
    """(train set, eval set, format name): read, checked and tokenised before the model loads.

    Every rank reads and checks the files itself, so a file that cannot be read is one line on
    every rank (with file:line), never a rank left waiting in a collective. Rank 0 tokenises first
    and the others reuse its cache. Rows that cannot train are dropped and counted; with no row
    left the run stops with the limit or the fix to change.
    """
    train_rows, eval_rows = load_splits(args.dataset, args.seed, args.columns)
    with accelerator.main_process_first():
        train_all, fmt = tokenize_counted(train_rows, tokenizer, args.max_length)
        eval_all, _ = tokenize_counted(eval_rows, tokenizer, args.max_length)
    train_set, eval_set = usable(train_all, "training", args), usable(eval_all, "evaluation", args)
    if accelerator.is_main_process:
        print(f"data ({fmt}): training {counted(train_all)}; evaluation {counted(eval_all)}", flush=True)
    if args.packing:
        train_set = pack(train_set, args.max_length)
    steps_per_epoch(len(train_set) // args.batch_size // launch.data_parallel_size, args.grad_accum)
    return train_set, eval_set, fmt


def counted(tokenized) -> str:
    """`1,000 rows: 960 used, 40 dropped (too long: 30, empty target: 10)`."""
    from collections import Counter

    reasons = Counter(reason for reason in tokenized["dropped"] if reason)
    dropped = sum(reasons.values())
    line = f"{len(tokenized):,} rows: {len(tokenized) - dropped:,} used"
    if dropped:
        line += f", {dropped:,} dropped ({', '.join(f'{why}: {n:,}' for why, n in reasons.most_common())})"
    return line


def usable(tokenized, split: str, args):
    """The rows that can train; none at all is a refusal that names the limit or the fix."""
    kept = tokenized.select([i for i, why in enumerate(tokenized["dropped"]) if not why])
    if len(kept):
        return kept.remove_columns(["dropped", "needs"])
    too_long = [needs for needs, why in zip(tokenized["needs"], tokenized["dropped"]) if why.startswith("too long")]
    if too_long:
        fix = f"pass --max-length {min(too_long)} or more (the shortest row needs that many tokens)"
    else:
        fix = "fix the rows (or map your columns with --columns)"
    refuse(f"no {split} row can be used: {counted(tokenized)}; {fix}")


def column_renames(columns: str | None) -> dict:
    """--columns "instruction=question,response=answer" -> {"question": "instruction", "answer": "response"}."""
    pairs = [(new.strip(), old.strip()) for new, _, old in (pair.partition("=") for pair in (columns or "").split(","))
             if old.strip()]
    targets = [new for new, _ in pairs]
    twice = sorted({new for new in targets if targets.count(new) > 1})
    if twice:
        refuse(f"--columns maps more than one column onto {', '.join(twice)}; give each target column once")
    return {old: new for new, old in pairs}


def check_files(files: list[Path], columns: str | None) -> None:
    """JSON and text files, read line by line: the first line that is not UTF-8, not JSON, or holds
    something other than text where text belongs is named as file:line (datasets would raise a long
    traceback from deep inside pyarrow)."""
    renames = column_renames(columns)
    for path in files:
        if suffix(path) not in (".jsonl", ".json", ".txt", ".csv", ".tsv"):
            continue
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8-sig")  # a byte-order mark at the start is fine (datasets skips it too)
        except UnicodeDecodeError as error:
            line = raw.count(b"\n", 0, error.start) + 1
            refuse(f"{path}:{line}: not UTF-8 (byte 0x{raw[error.start]:02x}); save the file as UTF-8")
        if not text.strip():
            refuse(f"{path} is empty; put rows in it or delete it")
        if suffix(path) == ".json":  # one JSON document (a list of rows), or JSON Lines under this name
            try:
                document = json.loads(text)
            except json.JSONDecodeError as error:
                if text.lstrip().startswith("["):
                    refuse(f"{path}:{error.lineno}: not valid JSON ({error.msg}, column {error.colno}); fix the file")
            else:
                if isinstance(document, dict) and any(isinstance(value, list) for value in document.values()):
                    refuse(f"{path} is one JSON object of lists, not rows; save the rows as a JSON array "
                           "([{\"column\": value, ...}, ...]) or as JSON Lines (one object per line)")
                continue
        if suffix(path) not in (".jsonl", ".json"):
            continue
        # Rows end at "\n" only: str.splitlines() would also cut a row at U+2028 inside a string.
        for number, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                refuse(f"{path}:{number}: not valid JSON ({error.msg}, column {error.colno}); fix or delete that line")
            if not isinstance(row, dict):
                refuse(f"{path}:{number}: a row must be a JSON object ({{\"column\": value, ...}}), "
                       f"got {type(row).__name__}; fix or delete that line")
            for column, value in row.items():
                if renames.get(column, column) in TEXT_COLUMNS and not isinstance(value, (str, type(None))):
                    refuse(f"{path}:{number}: `{column}` must be text (or null), got {json.dumps(value)[:40]}; "
                           "fix that line")


def load_splits(spec: str | None, seed: int, columns: str | None = None):
    """(train, eval) `datasets.Dataset`s from a hub id, a folder, or a single file.

    `columns` renames the dataset's columns to the ones a format expects, e.g.
    "instruction=question,response=answer".
    """
    import datasets

    spec = str(spec or DEFAULT_DATASET)
    path = Path(spec)
    if path.is_file() and path.stat().st_size == 0:
        refuse(f"--dataset {spec} is an empty file; point it at a file or folder with training data")
    try:
        if path.is_file():
            check_files([path], columns)
            loaded = datasets.load_dataset(FILE_LOADERS.get(suffix(path), "json"), data_files={"train": str(path)},
                                           **LOADER_OPTIONS.get(suffix(path), {}))
        elif path.is_dir():
            loaded = load_folder(path, columns)
        else:
            loaded = datasets.load_dataset(spec)
    except Exception as error:  # datasets / pyarrow / the hub on data they cannot read: one line, not a traceback
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        refuse(f"--dataset {spec} cannot be read: {first}")
    train = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    if len(train) == 0:
        refuse(f"--dataset {spec} has no rows; point it at a file or folder with training data")
    if columns:
        mapping = column_renames(columns)
        missing = sorted(set(mapping) - set(train.column_names))
        if missing:
            refuse(f"--columns names {missing}, which --dataset does not have (it has {sorted(train.column_names)})")
        clash = sorted(new for new in mapping.values() if new in train.column_names and new not in mapping)
        if clash:
            refuse(f"--columns maps a column onto {', '.join(clash)}, which --dataset already has; map that one "
                   f"too (e.g. --columns {clash[0]}_old={clash[0]},...) or pick the existing column instead")
        loaded = loaded.rename_columns(mapping)
        train = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    loaded = with_text_columns(loaded)
    train = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    fmt = detect_format(train.column_names)  # no known columns: refused here, on every rank
    eval_name = next((name for name in EVAL_SPLIT_NAMES if name in loaded), None)
    if eval_name is not None:
        return train, loaded[eval_name]
    if len(train) < 2:
        refuse(f"--dataset {spec} has {len(train)} rows; it needs at least 2 (some are held out for evaluation)")
    held_out = max(1, min(256, len(train) // 20))
    split = train.train_test_split(test_size=held_out, seed=seed)
    if all(row_problem(row, fmt) is None for row in split["test"]):
        return split["train"], split["test"]
    # Hold out rows that can train instead: an unusable row there could leave evaluation empty while
    # training has rows (it stays in training, where it is dropped and counted).
    good = [i for i, row in enumerate(train) if row_problem(row, fmt) is None]
    if len(good) <= held_out:
        return split["train"], split["test"]  # too few good rows: the tokenised counts name the problem
    import datasets

    split = train.select(good).train_test_split(test_size=held_out, seed=seed)
    bad = train.select(sorted(set(range(len(train))) - set(good)))
    return datasets.concatenate_datasets([split["train"], bad]), split["test"]


def with_text_columns(loaded):
    """ShareGPT's `conversations` column is `messages`; a column of numbers that a format reads as text
    (a CSV or parquet answer column of 0, 1, 2) becomes text, as it would be written in a prompt."""
    from datasets import Value

    for split, part in loaded.items():
        if "conversations" in part.column_names and "messages" not in part.column_names:
            part = part.rename_column("conversations", "messages")
        for name, feature in part.features.items():
            if name in TEXT_COLUMNS and isinstance(feature, Value) and feature.dtype.startswith(("int", "uint", "float")):
                part = part.cast_column(name, Value("string"))
        loaded[split] = part
    return loaded


def load_folder(folder: Path, columns: str | None = None):
    """The folder's splits: files named train* / eval* / validation* (val*, dev*) / test* (other files
    are notes or configs), or, when nothing is named so, its data files as the training split."""
    import datasets

    files = sorted(p for p in folder.iterdir() if p.is_file() and suffix(p) in FILE_LOADERS)
    if not files:
        refuse(f"--dataset {folder} holds no .jsonl/.json/.parquet/.txt/.csv/.tsv file")
    named = [f for f in files if split_of(f)]
    by_split = {}
    for file in named or files:
        by_split.setdefault(split_of(file) or "train", []).append(file)
    if "train" not in by_split:
        refuse(f"--dataset {folder} has {', '.join(sorted(by_split))} files but no train* file; name the training "
               "file train.jsonl (or similar), or point --dataset at it")
    kinds = {FILE_LOADERS[suffix(f)] + LOADER_OPTIONS.get(suffix(f), {}).get("delimiter", "") for f in named or files}
    if len(kinds) > 1:
        listed = ", ".join(f.name for f in named or files)
        refuse(f"--dataset {folder} mixes file formats ({listed}); keep one format, or point --dataset at one file")
    check_files(named or files, columns)
    if int(os.environ.get("RANK", "0")) == 0:  # which file is which split, and what was left out
        used = "; ".join(f"{split}: {', '.join(f.name for f in group)}"
                         for split, group in sorted(by_split.items(), key=lambda item: item[0] != "train"))
        left = [f.name for f in folder.iterdir() if f.is_file() and f not in (named or files)]
        print(f"files: {used}" + (f"; not read: {', '.join(sorted(left))}" if left else ""), flush=True)
    first = suffix((named or files)[0])
    # one split at a time: datasets reads every split with the first split's columns otherwise
    loaded = datasets.DatasetDict({
        split: datasets.load_dataset(FILE_LOADERS[first], data_files={split: [str(f) for f in group]},
                                     **LOADER_OPTIONS.get(first, {}))[split]
        for split, group in by_split.items()})
    columns_of = {split: sorted(part.column_names) for split, part in loaded.items()}
    if len({tuple(names) for names in columns_of.values()}) > 1:
        refuse(f"--dataset {folder}: the splits have different columns ({'; '.join(f'{s}: {c}' for s, c in columns_of.items())}); "
               "give every file the same columns")
    return loaded


def tokenize(dataset, tokenizer, max_length: int, packing: bool = False):
    """(tokenised dataset of the usable rows, format name); with `packing`, rows are packed into
    sequences of up to `max_length` tokens whose `position_ids` restart at every row."""
    tokenized, fmt = tokenize_counted(dataset, tokenizer, max_length)
    tokenized = tokenized.select([i for i, why in enumerate(tokenized["dropped"]) if not why])
    tokenized = tokenized.remove_columns(["dropped", "needs"])
    return (pack(tokenized, max_length) if packing else tokenized), fmt


def tokenize_counted(dataset, tokenizer, max_length: int):
    """(every row tokenised, format name). Each row also gets `dropped`: why it cannot train ("" when
    it can), and `needs`: the --max-length that keeps one of its targets."""
    fmt = detect_format(dataset.column_names)

    def one_row(row):
        problem = row_problem(row, fmt)
        if problem is None:
            try:
                whole = tokenize_row(row, tokenizer, fmt, None)
            except RowProblem as error:
                problem = str(error)
        if problem is not None:
            return {"input_ids": [], "labels": [], "dropped": problem, "needs": 0}
        # The label of token i is predicted from token i - 1: the first target at i needs i + 1 tokens.
        needs = next((i + 1 for i, label in enumerate(whole["labels"]) if i and label != IGNORE), 0)
        # A row whose targets were all cut off by --max-length teaches nothing.
        dropped = f"too long for --max-length {max_length}" if needs > max_length else ""
        return {"input_ids": whole["input_ids"][:max_length], "labels": whole["labels"][:max_length],
                "dropped": dropped, "needs": needs}

    return dataset.map(one_row, remove_columns=dataset.column_names, desc="tokenising"), fmt


def pack(tokenized, max_length: int):
    """Greedy packing, in order, without splitting a row.

    Each packed sequence carries `position_ids` that restart at 0 for every row; transformers
    reads them as packed sequences and keeps attention inside each row (sdpa / eager build a
    block-diagonal causal mask, flash-attention uses the varlen kernel). A row's first label is
    its masked BOS or prompt, so no target crosses a boundary.
    """
    import datasets

    packed = {"input_ids": [], "labels": [], "position_ids": []}
    current = {key: [] for key in packed}
    for row in tokenized:
        length = len(row["input_ids"])
        if current["input_ids"] and len(current["input_ids"]) + length > max_length:
            for key in packed:
                packed[key].append(current[key])
            current = {key: [] for key in packed}
        current["input_ids"] += row["input_ids"]
        current["labels"] += row["labels"]
        current["position_ids"] += list(range(length))
    if current["input_ids"]:
        for key in packed:
            packed[key].append(current[key])
    return datasets.Dataset.from_dict(packed)


class PadToLongest:
    """Pads a micro-batch to its longest row; padding is masked out of attention and loss.

    Packed rows have no attention mask: their padding gets positions of its own (a separate
    "row"), so nothing real attends to it, and its labels are ignored.
    """

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict:
        longest = max(len(row["input_ids"]) for row in rows)
        packed = "position_ids" in rows[0]
        batch = {"input_ids": [], "labels": [], ("position_ids" if packed else "attention_mask"): []}
        for row in rows:
            length = len(row["input_ids"])
            pad = longest - length
            batch["input_ids"].append(row["input_ids"] + [self.pad_token_id] * pad)
            batch["labels"].append(row["labels"] + [IGNORE] * pad)
            if packed:
                batch["position_ids"].append(row["position_ids"] + list(range(pad)))
            else:
                batch["attention_mask"].append([1] * length + [0] * pad)
        return {key: torch.tensor(value) for key, value in batch.items()}


def make_loaders(train, evaluation, collate, batch_size: int, workers: int | None = None):
    """Shuffled training batches (the ragged last batch dropped) and ordered evaluation batches,
    each micro-batch made by `collate` (a list of rows -> a dict of tensors).

    On a GPU, `workers` processes (default 2) collate the next batches while the GPU computes and
    pinned memory lets the copy to the GPU overlap too; on CPU the workers would only take cores
    from the ranks, so the default there is 0.
    """
    on_gpu = torch.cuda.is_available()
    workers = (2 if on_gpu else 0) if workers is None else workers
    common = dict(batch_size=batch_size, collate_fn=collate, num_workers=workers,
                  pin_memory=on_gpu, persistent_workers=workers > 0)
    train_loader = DataLoader(train, shuffle=True, drop_last=True, **common)
    eval_loader = DataLoader(evaluation, shuffle=False, **common)
    return train_loader, eval_loader


def target_tokens(batch: dict) -> torch.Tensor:
    """How many tokens of the batch are predicted and scored (labels are shifted by one)."""
    return (batch["labels"][:, 1:] != IGNORE).sum()


def positions_with_targets(targets: torch.Tensor) -> torch.Tensor:
    """The sequence positions where some row of `targets` (labels shifted by one) has a target: the
    only positions the loss needs logits for. On the CPU, so that they index the hidden states on
    whichever device holds them (model parallel's last GPU too)."""
    return (targets != IGNORE).any(0).nonzero().squeeze(1).cpu()


def optimizer_steps(train_loader, grad_accum: int, start_step: int = 0):
    """Endless stream of (epoch, [grad_accum micro-batches]) from `start_step` on.

    An epoch's ragged tail is dropped, and a resumed run sees exactly the batches that the
    uninterrupted run would have seen.
    """
    from accelerate import skip_first_batches

    epoch, done = divmod(start_step, steps_per_epoch(len(train_loader), grad_accum))
    while True:
        loader = skip_first_batches(train_loader, done * grad_accum) if done else train_loader
        loader.set_epoch(epoch)  # the shuffle order depends on the seed and the epoch only
        group = []
        for batch in without_touching_the_global_rng(loader):
            group.append(batch)
            if len(group) == grad_accum:
                yield epoch, group
                group = []
        epoch, done = epoch + 1, 0


def without_touching_the_global_rng(loader):
    """Iterate `loader`; starting an iterator draws from torch's global RNG (the workers' base
    seed), which would shift every dropout mask after a resume. The draw is undone here, so a
    resumed run and an uninterrupted one see the same random numbers."""
    iterator = iter(loader)
    with torch.random.fork_rng(devices=[]):
        first = next(iterator, None)
    if first is None:
        return
    yield first
    yield from iterator


def steps_per_epoch(batches_per_process: int, grad_accum: int) -> int:
    steps = batches_per_process // grad_accum
    if steps == 0:
        refuse(f"one optimizer step needs --grad-accum {grad_accum} micro-batches per process, but the "
               f"training data gives only {batches_per_process} per process; lower --batch-size or --grad-accum, "
               "or give more rows (or launch fewer processes)")
    return steps
