"""The data half of preference tuning (DPO, KTO): pairs (or judged replies) read and checked as the supervised
rows are, each side tokenised as the supervised recipes tokenise a row (the prompt masked, the reply and its stop
signal trained), so a pair's tokens are what the model sees at inference.

A row of the result: `chosen_input_ids`, `chosen_labels`, `rejected_input_ids`, `rejected_labels` (int32;
labels aligned with the ids, formats.IGNORE where a token is not trained). Each side is cut to
--max-length; a pair with a side that keeps no target is dropped and counted. KTO's rows (prepare_feedback):
`input_ids`, `labels`, `label` (true: desirable), each with its mismatched row (`WithMismatched`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..refusal import refuse
from . import batches
from .checked_rows import load_sources
from .data_files import DEFAULT_PAIRS
from .feedback import feedback_format_of, feedback_problem, judged_replies
from .formats import IGNORE, DataFormat, chat_template_line
from .images import ROW_NUMBER, ImageRows, image_column, refuse_image_rows_without
from .pairs import (
    PAIR_FORMATS,
    SIDES,
    opening_system_texts,
    pair_format_of,
    pair_problem,
    pair_sides,
    renders_chat,
    side_format,
)
from .targets import NO_TOKENS, require_offsets, tokenize_rows
from .tokens import (
    REPORT_COLUMNS,
    data_path_code,
    dropped_reason,
    kept_tokens,
    many,
    mapped,
    needed_length,
    tokenised_features,
    training_sets,
)

PAIR_COLUMNS = [f"{side}_{column}" for side in SIDES for column in ("input_ids", "labels")]
UNTOKENISED = {"input_ids": NO_TOKENS, "labels": NO_TOKENS, "problem": "", "eos_added": 0, "stops": [], "boundary": False}


def prepare_pairs(accelerator, tokenizer, args, launch, processor=None):
    """(train set, eval set, format name) of preference pairs, as preparation.prepare makes them of
    supervised rows: every rank reads and checks the files, rank 0 tokenises first and the others reuse
    its cache, pairs that cannot train are dropped and counted in the `data (...)` line, none left is a
    refusal naming the fix. No packing: a pair's two sides are one example. The format carries the system
    turn every conversational pair opened with (run.json records it, as for chat rows). `processor` (a
    vision-language model's): pairs whose prompt holds images keep each side's rendering and the images' files,
    which images.PadImageRows turns into the model's inputs as the loader collates."""
    given = args.dataset or [str(DEFAULT_PAIRS)]  # the bundled pairs by default
    train_parts, eval_parts = load_sources(given, args.seed, args.columns, getattr(args, "eval_dataset", None),
                                           pair_format_of, pair_problem)
    with_margins = {"margin" in part.rows.column_names for part in train_parts + eval_parts}
    if len(with_margins) > 1:  # (before tokenising: the joined sets would not share their columns)
        refuse("some --dataset / --eval-dataset sources have a `margin` column and some have none; give every source "
               "one (0 where you have no margin) or none")
    require_offsets(tokenizer)  # on every rank, before rank 0 tokenises
    refuse_image_rows_without(processor, train_parts + eval_parts, args.model)

    def tokenised(part):
        images = ImageRows(processor, part.name) if processor is not None else None
        return tokenize_pairs(part.rows, part.fmt, tokenizer, args.max_length, images)

    with accelerator.main_process_first():
        train_tokens = [tokenised(part) for part in train_parts]
        eval_tokens = [tokenised(part) for part in eval_parts]
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


def tokenize_pairs(dataset, fmt: str, tokenizer, max_length: int, images=None):
    """Every pair tokenised: the 2N sides of a batch of N pairs in one targets.tokenize_rows call, then
    regrouped. Each pair also gets what tokens.tokenize_counted gives a row for the data line: `dropped`
    (the pair's problem, else a side's, else too long: `needs`, the larger side's, above `max_length`),
    `cut` (a side cut), and the two sides' `eos_added`, `stops` and `boundary`. A source with a `margin` column
    (a number a pair: how much better the chosen reply is, TRL's reward-model margin) keeps it; a pair without
    a number there is dropped. `images` (a vision-language model's run: an images.ImageRows of the source): each
    side keeps its rendering (`chosen_text`, `rejected_text`), the pair its images' files (`images`: placed in the
    prompt, the same for both sides), and a pair is never cut, as tokens.tokenize_counted keeps a row."""
    supervised = side_format(fmt)
    margins = "margin" in dataset.column_names
    column = image_column(dataset.column_names) if images else None
    if images and supervised != "messages":
        refuse(f"pairs with images must be conversational (a prompt of chat turns placing them); these are {fmt} "
               "(docs/data.md#images)")
    extra = ["chosen_text", "rejected_text", "images", "image_problem", ROW_NUMBER] if images else []

    def batch_of_pairs(columns: dict, code: str) -> dict:  # `code` only keys datasets' cache (see tokens.mapped)
        rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
        found = [pair_sides(row, fmt) for row in rows]
        if margins:
            found = [pair if isinstance(pair, str) or isinstance(row["margin"], (int, float)) else "no margin"
                     for pair, row in zip(found, rows)]
        tokenised = iter(tokenize_rows([side for pair in found if not isinstance(pair, str) for side in pair],
                                       tokenizer, supervised, images=bool(images)))
        out = {key: [] for key in [*PAIR_COLUMNS, *REPORT_COLUMNS, *(["margin"] if margins else []), *extra]}
        if margins:
            out["margin"] = [float(row["margin"]) if isinstance(row["margin"], (int, float)) else 0.0 for row in rows]
        for row, pair in zip(rows, found):
            sides = (UNTOKENISED, UNTOKENISED) if isinstance(pair, str) else (next(tokenised), next(tokenised))
            lengths = [needed_length(side["labels"]) for side in sides]
            untrained = [f"{name}: no trained token" for name, length in zip(SIDES, lengths) if not length]
            problem = pair if isinstance(pair, str) else next(
                (side["problem"] for side in sides if side["problem"]), untrained[0] if untrained else "")
            dropped = dropped_reason(problem, max(lengths), max_length)
            needs = max(lengths)
            if images:
                files, image_problem, dropped, needs = pair_images(row, sides, column, images, problem, max_length)
                for name, side in zip(SIDES, sides):
                    out[f"{name}_text"].append("" if dropped else side.get("text", ""))
                out["images"].append([] if dropped else files)
                out["image_problem"].append(image_problem)
                out[ROW_NUMBER].append(row.get(ROW_NUMBER, 0))
            kept = [kept_tokens(side, None if images else max_length, keep=not dropped) for side in sides]
            for name, side in zip(SIDES, kept):
                out[f"{name}_input_ids"].append(side["input_ids"])
                out[f"{name}_labels"].append(side["labels"])
            out["dropped"].append(dropped)
            out["needs"].append(needs)
            out["cut"].append(any(side["cut"] for side in kept))
            out["eos_added"].append(sum(side["eos_added"] for side in kept))
            out["stops"].append(list(dict.fromkeys(stop for side in kept for stop in side["stops"])))
            out["boundary"].append(any(side["boundary"] for side in kept))
        return out

    features = pair_features(margins)
    if images:
        from datasets import List, Value

        features.update({"chosen_text": Value("string"), "rejected_text": Value("string"),
                         "images": List(Value("string")), "image_problem": Value("string"), ROW_NUMBER: Value("int64")})
    tokenised = mapped(dataset, batch_of_pairs, features, data_path_code("pairs.py", "preferences.py"))
    if images:
        images.refuse_problems(tokenised)
    return tokenised


def pair_images(row: dict, sides, column, images, problem: str, max_length: int):
    """(files, why they cannot train, why the pair is dropped, the length it needs) of a pair with images
    (images.ImageRows.fitted, for its longer side): placed in its prompt, the same for both sides (a reply placing
    an image is a problem of the pair's)."""
    if problem:
        return [], "", problem, 0
    places = [side["places"] for side in sides]
    if places[0] != places[1]:
        return [], "", "its chosen and rejected replies place different images (place them in the prompt)", 0
    return images.fitted(row, column, places[0], max(len(side["input_ids"]) for side in sides), max_length)


def pair_features(margins: bool = False):
    """The four token columns as int32 (as tokens.tokenised_features), then what the data line counts, and the
    pairs' `margin` where the source has one."""
    from datasets import Features, Value

    row = tokenised_features()
    return Features({**{column: row[column.partition("_")[2]] for column in PAIR_COLUMNS},
                     **{column: row[column] for column in REPORT_COLUMNS},
                     **({"margin": Value("float32")} if margins else {})})


def chosen_rows(pairs):
    """The pairs' chosen sides as supervised rows (`input_ids`, `labels`): what a trained model should answer."""
    images = ["images"] if "images" in pairs.column_names else []  # pairs with images: the prompt's
    return pairs.select_columns(["chosen_input_ids", "chosen_labels", *images]).rename_columns(
        {"chosen_input_ids": "input_ids", "chosen_labels": "labels"})


def prepare_feedback(accelerator, tokenizer, args, launch):
    """(train set, eval set, format name) of KTO's judged replies, as prepare_pairs makes pairs: preference pairs
    become two rows (their chosen reply desirable, their rejected one undesirable). Each row comes with its
    mismatched row (`WithMismatched`). Refused: training rows all of one label (KTO weighs the two against the
    policy's KL to the reference: it needs both)."""
    given = args.dataset or [str(DEFAULT_PAIRS)]  # the bundled pairs by default, each two judged replies
    train_parts, eval_parts = load_sources(given, args.seed, args.columns, getattr(args, "eval_dataset", None),
                                           feedback_format_of, feedback_problem)
    require_offsets(tokenizer)
    with accelerator.main_process_first():
        train_tokens = [tokenize_feedback(part.rows, part.fmt, tokenizer, args.max_length) for part in train_parts]
        eval_tokens = [tokenize_feedback(part.rows, part.fmt, tokenizer, args.max_length) for part in eval_parts]
    train_set, eval_set = training_sets(accelerator, args, train_parts, train_tokens, eval_parts, eval_tokens)
    desirable = int(np.count_nonzero(train_set["label"]))
    undesirable = len(train_set) - desirable
    if not desirable or not undesirable:
        refuse(f"every one of the {many(len(train_set), 'training row')} is labelled {'true' if desirable else 'false'}; "
               "KTO needs replies to learn from (label true) and replies to avoid (label false): add rows of the "
               "other label (desirable replies alone train with lora.py / full.py, as SFT rows)")
    if accelerator.is_main_process:
        pairs = " (each preference pair gives one of each)" if any(part.fmt in PAIR_FORMATS for part in train_parts) else ""
        print(f"data: {desirable:,} desirable and {undesirable:,} undesirable replies to train on{pairs}"
              f"{weights_advice(desirable, undesirable, args)}", flush=True)
    data_format = DataFormat("+".join(sorted({part.fmt for part in train_parts})), shared_system_prompt(train_parts))
    chat_template_line(accelerator, tokenizer, args, renders_chat(data_format))
    batches.say_steps(accelerator, len(train_set), args, launch.data_parallel_size, "rows")
    return WithMismatched(train_set, args.max_length), WithMismatched(eval_set, args.max_length), data_format


def weights_advice(desirable: int, undesirable: int, args) -> str:
    """`; with this imbalance ...` where neither weight is in the range the KTO paper gives (its Eq. 8: the
    desirable rows' weighted count between 1 and 4/3 times the undesirable rows'), as TRL warns; else ""."""
    ratio = undesirable / desirable
    desirable_range = (ratio * args.undesirable_weight, ratio * args.undesirable_weight * 4 / 3)
    undesirable_range = (args.desirable_weight / ratio * 3 / 4, args.desirable_weight / ratio)
    if desirable == undesirable or desirable_range[0] <= args.desirable_weight <= desirable_range[1] or \
            undesirable_range[0] <= args.undesirable_weight <= undesirable_range[1]:
        return ""
    return (f"; with this imbalance the KTO paper advises --desirable-weight {desirable_range[0]:.2f} to "
            f"{desirable_range[1]:.2f} or --undesirable-weight {undesirable_range[0]:.2f} to {undesirable_range[1]:.2f}")


def tokenize_feedback(dataset, fmt: str, tokenizer, max_length: int):
    """Every judged reply tokenised as a supervised row, with its `label`; a preference pair gives two rows.
    Each row also gets what tokens.tokenize_counted gives a row for the data line. A batch of pairs gives its
    chosen replies, then its rejected ones, so that a row's neighbour (whose reply its mismatched row borrows)
    answers another prompt."""
    supervised = side_format(fmt)
    width = 2 if fmt in PAIR_FORMATS else 1  # replies a row gives

    def batch_of_rows(columns: dict, code: str) -> dict:  # `code` only keys datasets' cache (see tokens.mapped)
        found = [judged_replies(dict(zip(columns, values)), fmt) for values in zip(*columns.values())]
        judged = [(replies, False) if isinstance(replies, str) else replies[i] for i in range(width) for replies in found]
        tokenised = iter(tokenize_rows([reply for reply, _ in judged if not isinstance(reply, str)], tokenizer,
                                       supervised))
        out = {key: [] for key in ["input_ids", "labels", "label", *REPORT_COLUMNS]}
        for reply, label in judged:
            row = dict(UNTOKENISED, problem=reply) if isinstance(reply, str) else next(tokenised)
            needs = needed_length(row["labels"])
            dropped = dropped_reason(row["problem"], needs, max_length)
            for key, value in {**kept_tokens(row, max_length, keep=not dropped), "dropped": dropped,
                               "needs": needs, "label": label}.items():
                out[key].append(value)
        return out

    return mapped(dataset, batch_of_rows, feedback_features(), data_path_code("feedback.py", "preferences.py"))


def feedback_features():
    """The supervised rows' columns (tokens.tokenised_features) and the label."""
    from datasets import Features, Value

    return Features({**tokenised_features(), "label": Value("bool")})


class WithMismatched(torch.utils.data.Dataset):
    """KTO's rows, each with its mismatched row: its prompt followed by the previous row's reply (the first row
    borrows the last one's), cut to `max_length`. The policy's and the reference's log-probabilities of those
    replies estimate KTO's KL term (TRL pairs each prompt with the previous reply of its batch, in the rows'
    order). The pairing is fixed by the rows' order, not by the shuffle, so the reference can score every row
    and its mismatched row once (kto_full.py). An item: the row, `kl_input_ids`, `kl_labels`, and `pair_index`
    (where its two reference scores are kept: reference.py)."""

    def __init__(self, rows, max_length: int):
        self.rows, self.max_length = rows, max_length

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        row, other = self.rows[index], self.rows[(index - 1) % len(self.rows)]
        start, other_start = first_target(row["labels"]), first_target(other["labels"])
        mismatched_ids = (row["input_ids"][:start] + other["input_ids"][other_start:])[:self.max_length]
        mismatched_labels = ([IGNORE] * start + other["labels"][other_start:])[:self.max_length]
        return {**row, "kl_input_ids": mismatched_ids, "kl_labels": mismatched_labels, "pair_index": index}

    # what reference.py keys its cache by: the rows' own (the pairing follows from them)
    @property
    def cache_files(self):
        return self.rows.cache_files

    @property
    def _fingerprint(self) -> str:
        return f"{self.rows._fingerprint}-mismatched"


def first_target(labels: list[int]) -> int:
    """Where a row's reply starts: its first trained token."""
    return next(i for i, label in enumerate(labels) if label != IGNORE)


def desirable_rows(rows: WithMismatched):
    """The desirable replies as supervised rows (`input_ids`, `labels`): what a trained model should answer."""
    table = rows.rows
    return table.select(np.flatnonzero(table["label"])).select_columns(["input_ids", "labels"])
