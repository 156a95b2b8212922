"""The data half of online training (GRPO): prompts, read as the other recipes read their files, each tokenised as
the model will be asked it (a text prompt as written, as TRL's tokenizer call takes it; chat messages through the
chat template with the assistant's turn opened), every other column kept for the reward functions.

Each step's prompts are drawn from a shuffle of the training rows that depends on the seed and the epoch only
(`step_prompts`), the same list on every rank and for any number of processes: which completions a rank samples
is its share of that list, so the same seed samples the same completions on one process or eight.
"""

from __future__ import annotations

import numpy as np

from ..refusal import refuse
from .data_files import DEFAULT_DATASET, EVAL_SPLIT_NAMES, read_splits, say_long_wait
from .formats import (CHAT_PROMPTS, PROMPT_IDS, TEXT_PROMPTS, DataFormat, chat_template_line, conversation,
                      reward_columns)
from .mixture import sources_of

DEFAULT_PROMPTS = DEFAULT_DATASET / "prompts"  # what grpo.py trains on by default


def prepare_prompts(accelerator, tokenizer, args):
    """(train set, eval set, format): the prompt rows with `prompt_ids`, every rank reading and checking them, rank
    0 tokenising first and the others reusing its cache. A prompt that leaves no room for --max-completion-length
    under --max-length is refused, counted, with the fix; so are rows without a usable `prompt`."""
    given = args.dataset or [str(DEFAULT_PROMPTS)]
    sources = sources_of(given)
    if len(sources) > 1 or sources[0].weight != 1:
        refuse("grpo.py reads one --dataset of prompts (no mixture yet); join them into one file")
    train, evaluation, name = prompt_splits(sources[0].spec, args)
    chat, held = prompt_format(train, name), prompt_format(evaluation, args.eval_dataset or name)
    if held != chat:
        refuse(f"--eval-dataset {args.eval_dataset} holds {held} and --dataset {name} {chat}; give both in one format")
    with accelerator.main_process_first():
        train = tokenised(train, tokenizer, chat == CHAT_PROMPTS)
        evaluation = tokenised(evaluation, tokenizer, chat == CHAT_PROMPTS)
    room = args.max_length - args.max_completion_length
    lengths = {split: np.array([len(ids) for ids in rows[PROMPT_IDS]]) for split, rows in
               (("--dataset", train), ("--eval-dataset" if args.eval_dataset else "its held-out", evaluation))}
    for split, rows in zip(lengths, (train, evaluation)):
        long = int((lengths[split] > room).sum())
        if long:
            refuse(f"{long:,} of {len(rows):,} prompts in {split} rows are longer than the {room} tokens --max-length "
                   f"{args.max_length} leaves beside --max-completion-length {args.max_completion_length} (the longest: "
                   f"{lengths[split].max()} tokens); raise --max-length to "
                   f"{lengths[split].max() + args.max_completion_length}, "
                   "shorten the completions, or remove those rows")
    data_format = DataFormat(chat, shared_system_prompt(train) if chat == CHAT_PROMPTS else None)
    chat_template_line(accelerator, tokenizer, args, chat == CHAT_PROMPTS)
    if accelerator.is_main_process:
        trained = lengths["--dataset"]
        print(f"data: {len(train):,} {chat} from {name} (longest {trained.max()} tokens, mean {trained.mean():.0f}), "
              f"{len(evaluation):,} for evaluation; columns for the rewards: "
              f"{', '.join(reward_columns(train)) or 'none'}", flush=True)
    return train, evaluation, data_format


def prompt_splits(spec: str, args):
    """(training rows, evaluation rows, the dataset's name): its eval / validation / test split, else
    --eval-dataset, else 5% of it (1 to 256 rows) held out by the seed."""
    loaded, name = read_splits(spec, args.columns)
    train = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    if args.eval_dataset:
        held, _ = read_splits(args.eval_dataset, args.columns)
        split = next((split for split in EVAL_SPLIT_NAMES if split in held), next(iter(held)))
        return train, held[split], name
    split = next((split for split in EVAL_SPLIT_NAMES if split in loaded), None)
    if split is not None:
        return train, loaded[split], name
    if len(train) < 2:
        refuse(f"--dataset {name} has {len(train)} prompt; it needs at least 2 (some are held out for evaluation)")
    parts = train.train_test_split(test_size=max(1, min(256, len(train) // 20)), seed=args.seed)
    return parts["train"], parts["test"], name


def prompt_format(rows, name: str) -> str:
    """TEXT_PROMPTS or CHAT_PROMPTS, from the `prompt` column; a dataset without one, or with a prompt that is
    neither text nor a list of messages, refused naming the row."""
    if "prompt" not in rows.column_names:
        refuse(f"--dataset {name} has no `prompt` column (it has {', '.join(rows.column_names)}); GRPO samples "
               "completions of prompts: map yours onto it with --columns question=prompt")
    chat = None
    for index, cell in enumerate(rows["prompt"]):
        kind = TEXT_PROMPTS if isinstance(cell, str) else CHAT_PROMPTS if conversation(cell) else None
        empty = kind is None or (kind == TEXT_PROMPTS and not cell.strip()) or (kind == CHAT_PROMPTS and not cell)
        if empty:
            refuse(f"--dataset {name}: row {index + 1}'s `prompt` is {str(cell)[:60]!r}; give text, or a list of "
                   "chat messages ({\"role\": ..., \"content\": ...}), in every row (or remove the row)")
        if chat is not None and kind != chat:
            refuse(f"--dataset {name} mixes text and chat prompts (row {index + 1}); keep one kind per dataset")
        chat = kind
    return chat


def tokenised(rows, tokenizer, chat: bool):
    """`rows` with PROMPT_IDS: a text prompt tokenised as written (the tokenizer's own special tokens, as TRL
    tokenises it), a conversation through the chat template with the assistant's turn opened."""
    def batch(columns: dict) -> dict:
        if chat:
            ids = [tokenizer.apply_chat_template([dict(turn) for turn in conversation(cell)], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"]
                   for cell in columns["prompt"]]
        else:
            ids = tokenizer(columns["prompt"])["input_ids"]
        return {PROMPT_IDS: ids}

    say_long_wait(len(rows), "prompts")
    return rows.map(batch, batched=True, batch_size=1_000, desc="tokenising prompts")


def shared_system_prompt(rows) -> str | None:
    """The system turn every chat prompt opens with, when it is one text (run.json's system_prompt: what
    generate.py and the benchmarks put before a prompt); None otherwise."""
    found = set()
    for cell in rows["prompt"]:
        turns = conversation(cell)
        if not turns or turns[0]["role"] != "system" or not isinstance(turns[0]["content"], str):
            return None
        found.add(turns[0]["content"])
        if len(found) > 1:
            return None
    return found.pop() if found else None


def step_prompts(rows: int, prompts_per_step: int, step: int, seed: int) -> tuple[int, list[int]]:
    """(epoch, the training rows of optimizer step `step` (1-based)): a shuffle of the rows by the seed and the
    epoch, cut into steps of `prompts_per_step` (an epoch's last partial step dropped)."""
    per_epoch = rows // prompts_per_step
    epoch, index = divmod(step - 1, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(rows)
    return epoch, order[index * prompts_per_step:(index + 1) * prompts_per_step].tolist()


def steps_per_epoch(rows: int, prompts_per_step: int) -> int:
    return rows // prompts_per_step
