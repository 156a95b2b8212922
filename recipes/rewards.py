"""Reward functions for recipes/grpo.py: read them, copy them, write your own beside them.

    accelerate launch ... recipes/grpo.py --dataset prompts.jsonl --reward recipes/rewards.py:exact_answer

A reward is a plain function with TRL's signature, `fn(prompts, completions, **columns) -> list[float | None]`:
one value per completion. `completions` are strings for text prompts and lists of chat messages for
conversational ones (the reply is the last message's content); every other column of the dataset arrives as a
keyword list aligned with them (`answer` below), with `completion_ids` too. Return None where a reward does not
apply to a completion; take `**columns` so that columns you do not use are accepted.
"""

import difflib
import re


def text_of(completion) -> str:
    """The completion's text: itself, or the content of its last message."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def exact_answer(prompts, completions, answer, **columns) -> list[float]:
    """1 where the completion, stripped of surrounding spaces, is the row's `answer`, else 0 (the bundled
    prompts' reward: data/prompts/)."""
    return [float(text_of(completion).strip() == str(expected).strip())
            for completion, expected in zip(completions, answer)]


def answer_similarity(prompts, completions, answer, **columns) -> list[float]:
    """Partial credit: how alike the completion and the row's `answer` are, from 0 to 1 (difflib's ratio of
    matching characters). A model that never gets the exact answer still sees which tries came closer."""
    return [difflib.SequenceMatcher(None, text_of(completion).strip(), str(expected).strip()).ratio()
            for completion, expected in zip(completions, answer)]


THINK_THEN_ANSWER = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL)


def think_answer_format(prompts, completions, **columns) -> list[float]:
    """1 where the completion is `<think>` reasoning followed by an `<answer>` block, each on its own lines
    (the format reasoning models are trained to follow), else 0."""
    return [float(bool(THINK_THEN_ANSWER.match(text_of(completion).strip()))) for completion in completions]
