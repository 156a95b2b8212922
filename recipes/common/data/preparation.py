"""The data pipeline, stage by stage: files -> checked rows -> tokens and labels -> packed sequences.

Each stage is a module of its own (data_files.py and checked_rows.py, tokens.py, packing.py); the
micro-batches the training loop takes are batches.py's.
"""

from __future__ import annotations

from . import batches
from .checked_rows import load_sources
from .packing import pack
from .targets import require_offsets
from .tokens import kept_rows, tokenize_counted, training_sets


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
    train_set, eval_set = training_sets(accelerator, args, train_parts, train_tokens, eval_parts, eval_tokens)
    if args.packing:
        with accelerator.main_process_first():  # rank 0 saves the packing plan, the others read it
            rows = len(train_set)
            train_set, fill = pack(train_set, args.max_length)
        if accelerator.is_main_process:
            print(f"packing: {rows:,} training rows into {len(train_set):,} sequences of up to {args.max_length:,} "
                  f"tokens, {fill:.1%} full", flush=True)
    batches.steps_per_epoch(len(train_set) // args.batch_size // launch.data_parallel_size, args.grad_accum)
    return train_set, eval_set, "+".join(sorted({part.fmt for part in train_parts}))


def tokenize(dataset, tokenizer, max_length: int, packing: bool = False):
    """(tokenised dataset of the usable rows, format name); with `packing`, rows are packed into
    sequences of up to `max_length` tokens whose `position_ids` restart at every row."""
    tokenized, fmt = tokenize_counted(dataset, tokenizer, max_length)
    tokenized = kept_rows(tokenized)
    return (pack(tokenized, max_length)[0] if packing else tokenized), fmt
