"""The data half of preference tuning (DPO): pairs read and checked as the supervised rows are, each side
tokenised as the supervised recipes tokenise a row (the prompt masked, the reply and its stop signal
trained), so a pair's tokens are what the model sees at inference.

A row of the result: `chosen_input_ids`, `chosen_labels`, `rejected_input_ids`, `rejected_labels` (int32;
labels aligned with the ids, formats.IGNORE where a token is not trained). Each side is cut to
--max-length; a pair with a side that keeps no target is dropped and counted.
"""

from __future__ import annotations

from . import batches
from .checked_rows import load_sources
from .data_files import DEFAULT_PAIRS
from .formats import DataFormat, chat_template_line
from .pairs import SIDES, opening_system_texts, pair_sides, renders_chat, side_format
from .targets import NO_TOKENS, require_offsets, tokenize_rows
from .tokens import (
    REPORT_COLUMNS,
    data_path_code,
    dropped_reason,
    kept_tokens,
    mapped,
    needed_length,
    tokenised_features,
    training_sets,
)

PAIR_COLUMNS = [f"{side}_{column}" for side in SIDES for column in ("input_ids", "labels")]
UNTOKENISED = {"input_ids": NO_TOKENS, "labels": NO_TOKENS, "problem": "", "eos_added": 0, "stops": [], "boundary": False}


def prepare_pairs(accelerator, tokenizer, args, launch):
    """(train set, eval set, format name) of preference pairs, as preparation.prepare makes them of
    supervised rows: every rank reads and checks the files, rank 0 tokenises first and the others reuse
    its cache, pairs that cannot train are dropped and counted in the `data (...)` line, none left is a
    refusal naming the fix. No packing: a pair's two sides are one example. The format carries the system
    turn every conversational pair opened with (run.json records it, as for chat rows)."""
    given = args.dataset or [str(DEFAULT_PAIRS)]  # the bundled pairs by default
    train_parts, eval_parts = load_sources(given, args.seed, args.columns, getattr(args, "eval_dataset", None),
                                           pairs=True)
    require_offsets(tokenizer)  # on every rank, before rank 0 tokenises
    with accelerator.main_process_first():
        train_tokens = [tokenize_pairs(part.rows, part.fmt, tokenizer, args.max_length) for part in train_parts]
        eval_tokens = [tokenize_pairs(part.rows, part.fmt, tokenizer, args.max_length) for part in eval_parts]
    train_set, eval_set = training_sets(accelerator, args, train_parts, train_tokens, eval_parts, eval_tokens, "pair")
    data_format = DataFormat("+".join(sorted({part.fmt for part in train_parts})), shared_system_prompt(train_parts))
    chat_template_line(accelerator, tokenizer, args, renders_chat(data_format))
    batches.say_steps(accelerator, len(train_set), args, launch.data_parallel_size, "pairs")
    return train_set, eval_set, data_format


def shared_system_prompt(parts) -> str | None:
    """The text of the system turn every conversational pair of the training sources opens with, when it is
    one text; None when a pair opens without one, their texts differ, or no source is conversational. As for
    chat rows (preparation.shared_system_prompt): scripts/generate.py puts it before a prompt by default."""
    found = set()
    for part in parts:
        texts = opening_system_texts(part.rows, part.fmt)
        if texts is None:
            return None
        found |= texts
    return found.pop() if len(found) == 1 else None


def tokenize_pairs(dataset, fmt: str, tokenizer, max_length: int):
    """Every pair tokenised: the 2N sides of a batch of N pairs in one targets.tokenize_rows call, then
    regrouped. Each pair also gets what tokens.tokenize_counted gives a row for the data line: `dropped`
    (the pair's problem, else a side's, else too long: `needs`, the larger side's, above `max_length`),
    `cut` (a side cut), and the two sides' `eos_added`, `stops` and `boundary`."""
    supervised = side_format(fmt)

    def batch_of_pairs(columns: dict, code: str) -> dict:  # `code` only keys datasets' cache (see tokens.mapped)
        found = [pair_sides(dict(zip(columns, values)), fmt) for values in zip(*columns.values())]
        tokenised = iter(tokenize_rows([side for pair in found if not isinstance(pair, str) for side in pair],
                                       tokenizer, supervised))
        out = {key: [] for key in [*PAIR_COLUMNS, *REPORT_COLUMNS]}
        for pair in found:
            sides = (UNTOKENISED, UNTOKENISED) if isinstance(pair, str) else (next(tokenised), next(tokenised))
            lengths = [needed_length(side["labels"]) for side in sides]
            untrained = [f"{name}: no trained token" for name, length in zip(SIDES, lengths) if not length]
            problem = pair if isinstance(pair, str) else next(
                (side["problem"] for side in sides if side["problem"]), untrained[0] if untrained else "")
            dropped = dropped_reason(problem, max(lengths), max_length)
            kept = [kept_tokens(side, max_length, keep=not dropped) for side in sides]
            for name, side in zip(SIDES, kept):
                out[f"{name}_input_ids"].append(side["input_ids"])
                out[f"{name}_labels"].append(side["labels"])
            out["dropped"].append(dropped)
            out["needs"].append(max(lengths))
            out["cut"].append(any(side["cut"] for side in kept))
            out["eos_added"].append(sum(side["eos_added"] for side in kept))
            out["stops"].append(list(dict.fromkeys(stop for side in kept for stop in side["stops"])))
            out["boundary"].append(any(side["boundary"] for side in kept))
        return out

    return mapped(dataset, batch_of_pairs, pair_features(), data_path_code("pairs.py", "preferences.py"))


def pair_features():
    """The four token columns as int32 (as tokens.tokenised_features), then what the data line counts."""
    from datasets import Features

    row = tokenised_features()
    return Features({**{column: row[column.partition("_")[2]] for column in PAIR_COLUMNS},
                     **{column: row[column] for column in REPORT_COLUMNS}})


def chosen_rows(pairs):
    """The pairs' chosen sides as supervised rows (`input_ids`, `labels`): what a trained model should answer."""
    return pairs.select_columns(["chosen_input_ids", "chosen_labels"]).rename_columns(
        {"chosen_input_ids": "input_ids", "chosen_labels": "labels"})
