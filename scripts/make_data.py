#!/usr/bin/env python
"""Regenerate the bundled toy dataset and its tokenizer.

Writes, relative to the repository root:

* ``data/train.jsonl`` (2048 rows) and ``data/eval.jsonl`` (128 rows, no
  instruction shared with train). Each row is
  ``{"instruction": "...", "response": "..."}``.
* ``data/tokenizer/``: a byte-level BPE tokenizer (vocabulary <= 512) trained
  on the training rows, saved with ``PreTrainedTokenizerFast.save_pretrained``.
* ``data/preferences/train.jsonl`` and ``eval.jsonl``: the same rows as
  preference pairs for DPO, ``{"prompt": ..., "chosen": ..., "rejected": ...}``
  (TRL's explicit-prompt text layout): the prompt is the recipes' prompt
  template around the instruction, chosen the correct response, rejected a
  plausible wrong one (another operation's answer).
* ``data/prompts/train.jsonl`` and ``eval.jsonl``: the same rows as GRPO
  prompts, ``{"prompt": ..., "answer": ...}``: the prompt template around the
  instruction, and the correct response for the exact-answer reward
  (recipes/rewards.py).
* ``data/chat/train.jsonl`` and ``eval.jsonl``: the same rows as one-turn
  conversations, ``{"messages": [{"role": "user", ...}, {"role": "assistant",
  ...}]}``, for a real model's chat template (README's real-model quickstart).
* ``data/vision/train.jsonl`` (1024 rows) and ``eval.jsonl`` (128 rows, images
  never drawn for train): a vision task in TRL's conversational layout, one
  56x56 PNG per row under ``data/vision/images/`` showing one solid shape on
  white, asked its colour or its shape, answered in one word.
* ``data/vision-pairs/train.jsonl`` and ``eval.jsonl``: the same rows as
  preference pairs with images (TRL's vision DPO layout: ``prompt`` turns
  placing the image, ``chosen`` the right answer, ``rejected`` a wrong one of
  the same kind), the images those of ``data/vision/images/``.

The task is a small mix of deterministic list operations over short digit
sequences written with spaces (one correct response per instruction)::

    Copy: 3 9 1     -> 3 9 1
    Reverse: 3 9 1  -> 1 9 3
    Sort: 3 9 1     -> 1 3 9

Everything is seeded (pure-Python ``random.Random``; the images drawn with PIL
and saved with fixed PNG settings), so running the script twice gives
byte-identical files.

Usage::

    python scripts/make_data.py [--seed 0] [--data-dir data]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA_DIR = REPO_ROOT / "data"

NUM_TRAIN = 2048
NUM_EVAL = 128
MIN_ITEMS = 3
MAX_ITEMS = 4
ALPHABET = "0123456789"

VOCAB_SIZE = 512
MODEL_MAX_LENGTH = 32768  # long rows split over a sequence parallel group fit (rotary positions: nothing learned)
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
# Order fixes the ids: <unk>=0, <s>=1, </s>=2, <pad>=3.
SPECIAL_TOKENS = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]

# Prompt template used by the recipes; the tokenizer is trained on it too so
# that its pieces become single tokens.
PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"

OPERATIONS: dict[str, Callable[[list[str]], list[str]]] = {
    "Copy": lambda items: list(items),
    "Reverse": lambda items: list(reversed(items)),
    "Sort": lambda items: sorted(items),
}


def make_row(rng: random.Random) -> dict[str, str]:
    op = rng.choice(sorted(OPERATIONS))
    n = rng.randint(MIN_ITEMS, MAX_ITEMS)
    items = [rng.choice(ALPHABET) for _ in range(n)]
    return {
        "instruction": f"{op}: {' '.join(items)}",
        "response": " ".join(OPERATIONS[op](items)),
    }


def make_splits(seed: int = 0) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Return (train_rows, eval_rows); eval instructions never occur in train."""
    rng = random.Random(seed)
    eval_rows: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(eval_rows) < NUM_EVAL:
        row = make_row(rng)
        if row["instruction"] not in seen:
            seen.add(row["instruction"])
            eval_rows.append(row)
    # Train rows are unique too, and disjoint from eval.
    train_rows: list[dict[str, str]] = []
    while len(train_rows) < NUM_TRAIN:
        row = make_row(rng)
        if row["instruction"] not in seen:
            seen.add(row["instruction"])
            train_rows.append(row)
    return train_rows, eval_rows


# The wrong answer a pair rejects: the operation a model confuses with the asked one (then any other).
CONFUSED_WITH = {"Copy": "Reverse", "Reverse": "Copy", "Sort": "Copy"}


def preference_pair(row: dict[str, str]) -> dict[str, str]:
    """The row as a preference pair: its response chosen, a plausible wrong answer rejected (another
    operation's answer; where every operation gives the same, the last item changed)."""
    op, items = row["instruction"].split(": ")
    items = items.split(" ")
    others = [CONFUSED_WITH[op]] + [other for other in sorted(OPERATIONS) if other not in (op, CONFUSED_WITH[op])]
    wrong = next((" ".join(OPERATIONS[other](items)) for other in others
                  if " ".join(OPERATIONS[other](items)) != row["response"]), None)
    if wrong is None:
        answer = row["response"].split(" ")
        wrong = " ".join(answer[:-1] + [ALPHABET[(ALPHABET.index(answer[-1]) + 1) % len(ALPHABET)]])
    return {"prompt": PROMPT_TEMPLATE.format(instruction=row["instruction"]), "chosen": row["response"],
            "rejected": wrong}


def grpo_prompt(row: dict[str, str]) -> dict[str, str]:
    """The row as a prompt for online training: the prompt template around its instruction, and the answer a
    reward compares completions with."""
    return {"prompt": PROMPT_TEMPLATE.format(instruction=row["instruction"]), "answer": row["response"]}


def chat_row(row: dict[str, str]) -> dict[str, list[dict[str, str]]]:
    """The row as a conversation: the instruction from the user, the response from the assistant."""
    return {"messages": [{"role": "user", "content": row["instruction"]},
                         {"role": "assistant", "content": row["response"]}]}


# The vision task: one solid shape on white per image, asked its colour or its shape (about equal shares).
NUM_VISION_TRAIN = 1024
NUM_VISION_EVAL = 128
IMAGE_SIZE = 56  # one 56x56 image: 16 patches of 14 pixels (4 tokens for the tiny Qwen2-VL, 16 for the tiny LLaVA)
BACKGROUND = (255, 255, 255)
# Well apart in RGB, so that even a random vision tower's features tell them apart.
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (240, 210, 20),
    "purple": (130, 40, 160),
    "orange": (245, 130, 20),
}
SHAPES = ("square", "circle", "triangle")
MIN_SHAPE, MAX_SHAPE = 36, 48  # side / diameter / base and height in pixels: most of the image
MARGIN = 2
QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is it?"}


def vision_spec(rng: random.Random) -> tuple[str, str, int, int, int]:
    """One image's drawing: (shape, colour, size, left, top)."""
    shape = rng.choice(SHAPES)
    colour = rng.choice(sorted(COLOURS))
    size = rng.randint(MIN_SHAPE, MAX_SHAPE)
    left = rng.randint(MARGIN, IMAGE_SIZE - MARGIN - size)
    top = rng.randint(MARGIN, IMAGE_SIZE - MARGIN - size)
    return shape, colour, size, left, top


def draw_shape(spec: tuple[str, str, int, int, int]):
    """The image of a spec: its shape filled with its colour on a white background (no anti-aliasing)."""
    from PIL import Image, ImageDraw

    shape, colour, size, left, top = spec
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    box = (left, top, left + size - 1, top + size - 1)
    fill = COLOURS[colour]
    if shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "circle":
        draw.ellipse(box, fill=fill)
    else:  # pointing up
        bottom, right = top + size - 1, left + size - 1
        draw.polygon([(left + (size - 1) // 2, top), (left, bottom), (right, bottom)], fill=fill)
    return image


def vision_row(spec: tuple[str, str, int, int, int], question: str, image: str) -> dict:
    """The row in TRL's conversational vision layout: the image's path relative to the data file."""
    answer = spec[1] if question == "colour" else spec[0]
    question_parts = [{"type": "image"}, {"type": "text", "text": QUESTIONS[question]}]
    return {"messages": [{"role": "user", "content": question_parts},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
            "images": [image]}


def make_vision_splits(seed: int = 0) -> dict[str, list[tuple[tuple[str, str, int, int, int], str]]]:
    """{"train": [(spec, question)], "eval": [...]}: every image drawn once (eval's never in train)."""
    rng = random.Random(f"vision:{seed}")  # its own stream: the other files do not change with it
    seen: set[tuple[str, str, int, int, int]] = set()
    splits = {}
    for split, count in (("eval", NUM_VISION_EVAL), ("train", NUM_VISION_TRAIN)):
        rows = []
        while len(rows) < count:
            spec = vision_spec(rng)
            question = rng.choice(sorted(QUESTIONS))
            if spec not in seen:
                seen.add(spec)
                rows.append((spec, question))
        splits[split] = rows
    return splits


def write_vision(vision_dir: Path, seed: int = 0) -> None:
    """data/vision/{train,eval}.jsonl and their images (PNG, fixed settings: the same bytes every run)."""
    image_dir = vision_dir / "images"
    image_dir.mkdir(parents=True, exist_ok=True)
    for old in image_dir.glob("*.png"):
        old.unlink()
    for split, rows in make_vision_splits(seed).items():
        out = []
        for index, (spec, question) in enumerate(rows, start=1):
            name = f"images/{split}_{index:05d}.png"
            draw_shape(spec).save(vision_dir / name, format="PNG", optimize=False, compress_level=9)
            out.append(vision_row(spec, question, name))
        write_jsonl(vision_dir / f"{split}.jsonl", out)


def vision_pair(row: dict, rng: random.Random) -> dict:
    """A vision row as a preference pair: its answer chosen, another of the same kind (colour or shape) rejected;
    the image's path from data/vision-pairs/."""
    user, reply = row["messages"]
    answer = reply["content"][0]["text"]
    wrong = rng.choice([other for other in (sorted(COLOURS) if answer in COLOURS else SHAPES) if other != answer])
    return {"prompt": [user], "chosen": [reply],
            "rejected": [{"role": "assistant", "content": [{"type": "text", "text": wrong}]}],
            "images": [f"../vision/{path}" for path in row["images"]]}


def write_vision_pairs(data_dir: Path, seed: int = 0) -> None:
    """data/vision-pairs/{train,eval}.jsonl from data/vision's rows (written first)."""
    rng = random.Random(f"vision-pairs:{seed}")  # its own stream: the other files do not change with it
    for split in ("train", "eval"):
        rows = [json.loads(line) for line in (data_dir / "vision" / f"{split}.jsonl").read_text().splitlines()]
        write_jsonl(data_dir / "vision-pairs" / f"{split}.jsonl", [vision_pair(row, rng) for row in rows])


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=False) + "\n")


def training_texts(rows: list[dict[str, str]]) -> list[str]:
    return [PROMPT_TEMPLATE.format(instruction=r["instruction"]) + r["response"] for r in rows]


def build_tokenizer(rows: list[dict[str, str]], output_dir: Path) -> None:
    """Train a byte-level BPE on ``rows`` and save it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        # Every byte is in the vocabulary, so any text can be tokenised.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_texts(rows), trainer=trainer)
    # BOS before every text, as Llama's tokenizers put it: inference tokenises a prompt with it
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, tokenizer.token_to_id(BOS_TOKEN))])

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    for old in output_dir.iterdir():
        if old.is_file():
            old.unlink()
    hf_tokenizer.save_pretrained(str(output_dir))


def check_tokenizer(output_dir: Path, rows: list[dict[str, str]]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(output_dir))
    assert tok.bos_token_id is not None and tok.eos_token_id is not None and tok.pad_token_id is not None
    assert len(tok) <= VOCAB_SIZE, len(tok)
    for text in training_texts(rows) + ["héllo wörld ✓ 🙂"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, (text, tok.decode(ids))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help="output folder (default: <repo>/data)",
    )
    args = parser.parse_args(argv)
    data_dir: Path = args.data_dir.resolve()

    train_rows, eval_rows = make_splits(args.seed)
    write_jsonl(data_dir / "train.jsonl", train_rows)
    write_jsonl(data_dir / "eval.jsonl", eval_rows)
    write_jsonl(data_dir / "preferences" / "train.jsonl", [preference_pair(row) for row in train_rows])
    write_jsonl(data_dir / "preferences" / "eval.jsonl", [preference_pair(row) for row in eval_rows])
    write_jsonl(data_dir / "prompts" / "train.jsonl", [grpo_prompt(row) for row in train_rows])
    write_jsonl(data_dir / "prompts" / "eval.jsonl", [grpo_prompt(row) for row in eval_rows])
    write_jsonl(data_dir / "chat" / "train.jsonl", [chat_row(row) for row in train_rows])
    write_jsonl(data_dir / "chat" / "eval.jsonl", [chat_row(row) for row in eval_rows])

    write_vision(data_dir / "vision", args.seed)
    write_vision_pairs(data_dir, args.seed)

    tok_dir = data_dir / "tokenizer"
    build_tokenizer(train_rows, tok_dir)
    check_tokenizer(tok_dir, train_rows + eval_rows)

    print(f"wrote {len(train_rows)} train rows, {len(eval_rows)} eval rows, their preference pairs, prompts and "
          f"conversations, {NUM_VISION_TRAIN} + {NUM_VISION_EVAL} vision rows with their images and pairs, and a tokenizer to {data_dir}")


if __name__ == "__main__":
    main()
