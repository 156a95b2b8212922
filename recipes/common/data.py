"""Any supported dataset -> tokenised rows with the prompt masked -> (packed) micro-batches.

Where the rows come from (hub, folder, file) and how they are batched lives here; how a row
of each format becomes tokens and labels lives in formats.py.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import DataLoader

from .formats import IGNORE, detect_format, tokenize_row
from .preflight import refuse

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATASET = REPO_ROOT / "data"

FILE_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}
EVAL_SPLIT_NAMES = ("eval", "validation", "valid", "test")


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
    if path.is_file():
        loaded = datasets.load_dataset(FILE_LOADERS.get(path.suffix, "json"), data_files={"train": str(path)})
    elif path.is_dir():
        loaded = load_folder(path)
    else:
        loaded = datasets.load_dataset(spec)
    train = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    if len(train) == 0:
        refuse(f"--dataset {spec} has no rows; point it at a file or folder with training data")
    if columns:
        mapping = dict(reversed(pair.split("=", 1)) for pair in columns.split(",") if "=" in pair)
        missing = sorted(set(mapping) - set(train.column_names))
        if missing:
            refuse(f"--columns names {missing}, which --dataset does not have (it has {sorted(train.column_names)})")
        loaded = loaded.rename_columns(mapping)
        train = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    eval_name = next((name for name in EVAL_SPLIT_NAMES if name in loaded), None)
    if eval_name is not None:
        return train, loaded[eval_name]
    if len(train) < 2:
        refuse(f"--dataset {spec} has {len(train)} rows; it needs at least 2 (some are held out for evaluation)")
    held_out = max(1, min(256, len(train) // 20))
    split = train.train_test_split(test_size=held_out, seed=seed)
    return split["train"], split["test"]


def load_folder(folder: Path):
    import datasets

    files = sorted(p for p in folder.iterdir() if p.suffix in FILE_LOADERS)
    if not files:
        refuse(f"--dataset {folder} holds no .jsonl/.json/.parquet/.txt/.csv file")
    def split_of(file: Path):
        return next((name for name in ("train", *EVAL_SPLIT_NAMES) if file.stem.lower().startswith(name)), None)

    # Files named train*/eval*/validation*/test* are the splits; other files are data only when
    # nothing is named so (a folder may also hold configs or notes).
    named = [f for f in files if split_of(f)]
    by_split = {}
    for file in named or files:
        by_split.setdefault(split_of(file) or "train", []).append(str(file))
    loader = FILE_LOADERS[(named or files)[0].suffix]
    return datasets.load_dataset(loader, data_files=by_split)


def tokenize(dataset, tokenizer, max_length: int, packing: bool = False):
    """(tokenised dataset, format name); with `packing`, rows are packed into sequences of up to
    `max_length` tokens whose `position_ids` restart at every row."""
    fmt = detect_format(dataset.column_names)
    tokenized = dataset.map(
        lambda row: tokenize_row(row, tokenizer, fmt, max_length),
        remove_columns=dataset.column_names,
        desc="tokenising",
    )
    # A row whose targets were all cut off by --max-length teaches nothing.
    tokenized = tokenized.filter(lambda row: any(label != IGNORE for label in row["labels"][1:]))
    return (pack(tokenized, max_length) if packing else tokenized), fmt


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


def make_loaders(train, evaluation, tokenizer, batch_size: int, workers: int | None = None):
    """Shuffled training batches (the ragged last batch dropped) and ordered evaluation batches.

    On a GPU, `workers` processes (default 2) collate the next batches while the GPU computes and
    pinned memory lets the copy to the GPU overlap too; on CPU the workers would only take cores
    from the ranks, so the default there is 0.
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    on_gpu = torch.cuda.is_available()
    workers = (2 if on_gpu else 0) if workers is None else workers
    common = dict(batch_size=batch_size, collate_fn=PadToLongest(pad_id), num_workers=workers,
                  pin_memory=on_gpu, persistent_workers=workers > 0)
    train_loader = DataLoader(train, shuffle=True, drop_last=True, **common)
    eval_loader = DataLoader(evaluation, shuffle=False, **common)
    return train_loader, eval_loader


def target_tokens(batch: dict) -> torch.Tensor:
    """How many tokens of the batch are predicted and scored (labels are shifted by one)."""
    return (batch["labels"][:, 1:] != IGNORE).sum()


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
               f"training data gives only {batches_per_process} per process; lower --batch-size or --grad-accum")
    return steps
