"""The data pipeline, stage by stage: files -> checked rows -> tokens and labels -> packed sequences.

Each stage is a module of its own (data_files.py and checked_rows.py, tokens.py, packing.py); the
micro-batches the training loop takes are batches.py's.
"""

from __future__ import annotations

import os

from . import batches
from .checked_rows import load_sources, unread_columns
from .mixture import draw, drawn_words, shares
from .packing import pack
from .targets import require_offsets
from .tokens import counted, kept_rows, tokenize_counted, usable


def prepare(accelerator, tokenizer, args, launch):
    """(train set, eval set, format name): read, checked and tokenised before the model loads.

    Every rank reads and checks the files itself, so a file that cannot be read is one line on
    every rank (with file:line), never a rank left waiting in a collective. Rank 0 tokenises first
    and the others reuse its cache. Rows that cannot train are dropped and counted; with no row
    left the run stops with the limit or the fix to change. Several --dataset sources are tokenised
    each on its own (each may have a format of its own), then drawn by their weights and joined.
    """
    train_parts, eval_parts = load_sources(args.dataset, args.seed, args.columns, getattr(args, "eval_dataset", None))
    require_offsets(tokenizer)  # on every rank, before rank 0 tokenises (in worker processes for a large set)
    with accelerator.main_process_first():
        train_tokens = [tokenize_counted(part.rows, tokenizer, args.max_length)[0] for part in train_parts]
        eval_tokens = [tokenize_counted(part.rows, tokenizer, args.max_length)[0] for part in eval_parts]
    mixed = len(train_parts) > 1
    kept = [usable(tokens, "training", args, part.name if mixed else "") for part, tokens in zip(train_parts, train_tokens)]
    drawn = [draw(rows, part.source, position, args.seed) for position, (part, rows) in enumerate(zip(train_parts, kept))]
    evaluation = [usable(tokens, "evaluation", args, part.name if mixed else "") for part, tokens in zip(eval_parts, eval_tokens)]
    train_set, eval_set = joined(drawn), joined(evaluation)
    if accelerator.is_main_process:
        for line in data_lines(train_parts, train_tokens, drawn, eval_parts, eval_tokens, len(eval_set)):
            print(line, flush=True)
        # where a rerun (or a resume) with the same rows, tokenizer and flags reads them: a folder per source
        folders = dict.fromkeys(os.path.dirname(tokens.cache_files[0]["filename"]) for tokens in train_tokens
                                if tokens.cache_files)
        if folders:
            print(f"data cache: {', '.join(folders)}", flush=True)
    if args.packing:
        with accelerator.main_process_first():  # rank 0 saves the packing plan, the others read it
            rows = len(train_set)
            train_set, fill = pack(train_set, args.max_length)
        if accelerator.is_main_process:
            print(f"packing: {rows:,} training rows into {len(train_set):,} sequences of up to {args.max_length:,} "
                  f"tokens, {fill:.1%} full", flush=True)
    batches.steps_per_epoch(len(train_set) // args.batch_size // launch.data_parallel_size, args.grad_accum)
    return train_set, eval_set, "+".join(sorted({part.fmt for part in train_parts}))


def joined(parts: list):
    import datasets

    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def data_lines(train_parts, train_tokens, drawn, eval_parts, eval_tokens, eval_rows: int) -> list[str]:
    """What each source gave: `data (messages): training 1,000 rows: 990 used ...; evaluation ...` for one
    source; a line per source and one for the mixture for several."""
    if len(train_parts) == 1:
        part, rows = train_parts[0], drawn[0]
        drew = f"; {drawn_words(part.source, len(rows))}" if part.source.weight != 1 else ""
        return [f"data ({part.fmt}): training {counted(train_tokens[0])}{drew}; evaluation {counted(eval_tokens[0])}"
                f"{unread_columns(part.rows.column_names, part.fmt)}"]
    held = {id(part.source): tokens for part, tokens in zip(eval_parts, eval_tokens)}
    lines = []
    for part, tokens, rows in zip(train_parts, train_tokens, drawn):
        evaluation = f"; evaluation {counted(held[id(part.source)])}" if id(part.source) in held else ""
        lines.append(f"data: {part.name} ({part.fmt}): training {counted(tokens)}; "
                     f"{drawn_words(part.source, len(rows))}{evaluation}"
                     f"{unread_columns(part.rows.column_names, part.fmt)}")
    trained = {id(part.source) for part in train_parts}
    for part, tokens in zip(eval_parts, eval_tokens):
        if id(part.source) not in trained:  # --eval-dataset
            lines.append(f"data: evaluation {part.name} ({part.fmt}): {counted(tokens)}")
    lines.append(f"data: {len(train_parts)} sources: {sum(map(len, drawn)):,} training rows "
                 f"({shares([part.name for part in train_parts], list(map(len, drawn)))}), "
                 f"{eval_rows:,} evaluation rows")
    return lines


def tokenize(dataset, tokenizer, max_length: int, packing: bool = False):
    """(tokenised dataset of the usable rows, format name); with `packing`, rows are packed into
    sequences of up to `max_length` tokens whose `position_ids` restart at every row."""
    tokenized, fmt = tokenize_counted(dataset, tokenizer, max_length)
    tokenized = kept_rows(tokenized)
    return (pack(tokenized, max_length)[0] if packing else tokenized), fmt
