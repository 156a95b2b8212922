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


def reward_model(path: str, batch_size: int = 16):
    """A reward function from a reward model: one saved by recipes/reward.py (its merged/) or reward_full.py (its
    model/), or any AutoModelForSequenceClassification with one label. Each completion's reward is the model's
    score of the prompt followed by it, tokenised as the reward recipes tokenise a pair's side (text: the tokenizer's
    special tokens, then EOS after the reply; chat: the tokenizer's chat template). Loaded at the first call, on
    this process's GPU when it has one, `batch_size` completions a forward.

        # my_rewards.py, beside your data
        from rewards import reward_model        # (recipes/ is on the path of a recipe's run)
        helpful = reward_model("outputs/reward/merged")

        accelerate launch ... recipes/grpo.py --dataset prompts.jsonl --reward my_rewards.py:helpful
    """
    loaded = {}

    def score(prompts, completions, **columns) -> list[float]:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not loaded:
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
            loaded["tokenizer"] = AutoTokenizer.from_pretrained(path)
            loaded["model"] = AutoModelForSequenceClassification.from_pretrained(path, dtype="auto").to(device).eval()
        tokenizer, model = loaded["tokenizer"], loaded["model"]
        rows = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(completion, list):  # chat: the whole conversation through the template
                text = tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=False)
                rows.append(tokenizer(text, add_special_tokens=False)["input_ids"])
            else:
                rows.append(tokenizer(prompt + completion)["input_ids"] + [tokenizer.eos_token_id])
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else tokenizer.pad_token_id
        scores = []
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                chunk = rows[start:start + batch_size]
                longest = max(map(len, chunk))
                ids = torch.tensor([row + [pad] * (longest - len(row)) for row in chunk], device=model.device)
                mask = torch.tensor([[1] * len(row) + [0] * (longest - len(row)) for row in chunk], device=model.device)
                scores += model(input_ids=ids, attention_mask=mask).logits[:, 0].float().tolist()
        return scores

    score.__name__ = f"reward_model({path!r})"
    return score
