"""Checked rows -> tokenised rows with the prompt masked -> (packed) micro-batches.

Where the rows come from (hub, folder, file) and how they are checked lives in data_files.py; how a
row of each format becomes tokens and labels lives in formats.py.
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader

from .data_files import filled_columns, load_splits, unread_columns
from .formats import IGNORE, detect_format
from .packing import pack
from .refusal import refuse
from .targets import require_offsets, tokenize_row, tokenize_rows  # noqa: F401 (tokenize_row: one row, for scripts and tests)

REPORT_COLUMNS = ["dropped", "needs", "cut", "eos_added", "stops", "boundary"]  # what the data line counts


def prepare(accelerator, tokenizer, args, launch):
    """(train set, eval set, format name): read, checked and tokenised before the model loads.

    Every rank reads and checks the files itself, so a file that cannot be read is one line on
    every rank (with file:line), never a rank left waiting in a collective. Rank 0 tokenises first
    and the others reuse its cache. Rows that cannot train are dropped and counted; with no row
    left the run stops with the limit or the fix to change.
    """
    train_rows, eval_rows = load_splits(args.dataset, args.seed, args.columns, getattr(args, "eval_dataset", None))
    require_offsets(tokenizer)  # on every rank, before rank 0 tokenises (in worker processes for a large set)
    with accelerator.main_process_first():
        train_all, fmt = tokenize_counted(train_rows, tokenizer, args.max_length)
        eval_all, _ = tokenize_counted(eval_rows, tokenizer, args.max_length)
    train_set, eval_set = usable(train_all, "training", args), usable(eval_all, "evaluation", args)
    if accelerator.is_main_process:
        print(f"data ({fmt}): training {counted(train_all)}; evaluation {counted(eval_all)}"
              f"{unread_columns(train_rows.column_names, fmt)}", flush=True)
        if train_all.cache_files:  # where a rerun (or a resume) with the same rows, tokenizer and flags reads them
            print(f"data cache: {os.path.dirname(train_all.cache_files[0]['filename'])}", flush=True)
    if args.packing:
        with accelerator.main_process_first():  # rank 0 writes the packed set, the others map its file
            rows = len(train_set)
            train_set, fill = pack(train_set, args.max_length)
        if accelerator.is_main_process:
            print(f"packing: {rows:,} training rows into {len(train_set):,} sequences of up to {args.max_length:,} "
                  f"tokens, {fill:.1%} full", flush=True)
    steps_per_epoch(len(train_set) // args.batch_size // launch.data_parallel_size, args.grad_accum)
    return train_set, eval_set, fmt


def counted(tokenized) -> str:
    """`1,000 rows: 960 used (12 of them cut to --max-length), 40 dropped (too long: 30, empty target: 10)`,
    then the stop signal replies end with and any prompt/target boundary inside a token."""
    from collections import Counter

    reasons = Counter(reason for reason in tokenized["dropped"] if reason)
    dropped = sum(reasons.values())
    line = f"{len(tokenized):,} rows: {len(tokenized) - dropped:,} used"
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


def usable(tokenized, split: str, args):
    """The rows that can train; none at all is a refusal that names what to change for each cause found."""
    kept = kept_rows(tokenized)
    if len(kept):
        return kept
    refuse(f"no {split} row can be used: {counted(tokenized)}; {'; '.join(fixes(tokenized))}")


def fixes(tokenized) -> list[str]:
    """What to change, one entry per kind of cause among the dropped rows, the commonest first."""
    from collections import Counter

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


def tokenize(dataset, tokenizer, max_length: int, packing: bool = False):
    """(tokenised dataset of the usable rows, format name); with `packing`, rows are packed into
    sequences of up to `max_length` tokens whose `position_ids` restart at every row."""
    tokenized, fmt = tokenize_counted(dataset, tokenizer, max_length)
    tokenized = kept_rows(tokenized)
    return (pack(tokenized, max_length)[0] if packing else tokenized), fmt


def kept_rows(tokenized):
    """The rows that can train, without the columns the data line counts."""
    return tokenized.select([i for i, why in enumerate(tokenized["dropped"]) if not why]).remove_columns(REPORT_COLUMNS)


ROWS_PER_PROCESS = 10_000  # below this a process of its own costs more than it saves


def preparing_processes(rows: int) -> int | None:
    """Processes that tokenise a large set together (every core of the machine: the other ranks only
    wait meanwhile); None, the calling process alone, for a small one."""
    processes = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                    rows // ROWS_PER_PROCESS)
    return processes if processes > 1 else None


def data_path_code() -> str:
    """A hash of the modules that turn rows into tokens and targets."""
    import hashlib
    from pathlib import Path

    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in ("formats.py", "targets.py", "data.py")))\
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
            needs = next((i + 1 for i, label in enumerate(labels) if i and label != IGNORE), 0)
            # A row whose targets were all cut off by --max-length teaches nothing.
            dropped = row["problem"] or (f"too long for --max-length {max_length}" if needs > max_length else "")
            keep = not dropped
            out["input_ids"].append(row["input_ids"][:max_length] if keep else [])
            out["labels"].append(labels[:max_length] if keep else [])
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
    if processes:  # the work is split over processes: the tokenizer's own threads would only compete (and warn)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenized = dataset.map(batch_of_rows, batched=True, batch_size=512, remove_columns=dataset.column_names,
                            fn_kwargs={"code": data_path_code()}, num_proc=processes, desc="tokenising")
    return tokenized, fmt


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
