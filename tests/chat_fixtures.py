"""Tokenizers and chat templates as real models have them, built offline for the data tests.

Three tokenizers, each trained in well under a second on the bundled data and on the chat rows
these tests generate (nothing is downloaded):
  bundled        data/tokenizer, the recipes' own character-level byte-level BPE;
  sentencepiece  BPE under a Metaspace pre-tokenizer ("▁" before the first word, newlines split
                 off as their own pieces), as Llama-2, Mistral-7B, Mixtral and Phi-3 tokenise;
  byte_level     byte-level BPE with GPT-2's split pattern, as Llama-3, Qwen and SmolLM2 tokenise.
Each is wrapped in transformers' PreTrainedTokenizerFast (bos <s>, eos </s>, pad <pad>, unk <unk>).

`with_template(name, family)` gives a fresh copy of tokenizer `name` holding the family's chat
template (tests/fixtures/chat_templates/<family>.jinja), its special tokens, and its own BOS / EOS
(index.json says which: a family without a BOS gets none).
"""

from __future__ import annotations

import functools
import json
import random
import string
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = REPO / "tests" / "fixtures" / "chat_templates"
BUNDLED_TOKENIZER = REPO / "data" / "tokenizer"
TOKENIZERS = ("bundled", "sentencepiece", "byte_level")
BASE_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def index() -> dict:
    """family -> {family, model, source, end_of_turn, bos_token, eos_token, special_tokens}."""
    return json.loads((TEMPLATES / "index.json").read_text())


FAMILIES = tuple(index())


# ---------------------------------------------------------------------------------------------------
# Chat rows: 1-3 turns, about half with a system prompt. No user or system text is a substring of a
# reply, so a reply found in the targets, or a prompt found there, is a fact about the masking.
# Replies start with a word (a sentencepiece tokenizer writes "▁The" alone, "The" after a header) and
# some hold "\n\n" (one byte-level token alone, two before a word).

SYSTEM_PROMPTS = ("You are a careful assistant. Answer in one line.", "Keep every answer short and exact.",
                  "You help with small puzzles about numbers.")
TASKS = {
    "sort": ("Please sort these numbers: {nums}", lambda xs: sorted(xs)),
    "reverse": ("Could you reverse this sequence: {nums}", lambda xs: xs[::-1]),
    "copy": ("Repeat after me exactly: {nums}", lambda xs: xs),
    "max": ("Which is the largest of {nums}?", lambda xs: [max(xs)]),
}
OPENINGS = ("The answer is {out}.", "Sure! Here it is: {out}", "Here you go:\n\n{out}", "{out}",
            "Done. Result:\n{out}\nAnything else?")


def chat_rows(count: int, seed: int = 0) -> list[dict]:
    """`count` rows of {"messages": [...]}, the same for the same seed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _ in range(rng.randint(1, 3)):
            ask, solve = TASKS[rng.choice(sorted(TASKS))]
            numbers = [rng.randint(0, 99) for _ in range(rng.randint(2, 6))]
            messages.append({"role": "user", "content": ask.format(nums=" ".join(map(str, numbers)))})
            answer = " ".join(map(str, solve(numbers)))
            messages.append({"role": "assistant", "content": rng.choice(OPENINGS).format(out=answer)})
        rows.append({"messages": messages})
    return rows


def training_texts() -> list[str]:
    """What the fixture tokenizers learn their merges from: the bundled rows and chat rows."""
    texts = []
    for line in (REPO / "data" / "train.jsonl").read_text().splitlines():
        row = json.loads(line)
        texts.append(f"### Instruction:\n{row['instruction']}\n\n### Response:\n{row['response']}")
    for row in chat_rows(400, seed=1):
        texts.append("\n\n".join(turn["content"] for turn in row["messages"]))
    # the words templates put around the turns, so that they are pieces of their own as in real vocabularies
    texts += ["system user assistant model developer\n### System:\n### User:\n### Assistant:\n[INST] [/INST]\n"
              "# Instructions\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"] * 20
    return texts


# ---------------------------------------------------------------------------------------------------
# Tokenizers

@functools.lru_cache(maxsize=None)
def _tokenizer_json(name: str) -> str:
    """The serialised `tokenizers.Tokenizer` of one fixture kind (trained once per test session)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if name == "bundled":
        return (BUNDLED_TOKENIZER / "tokenizer.json").read_text()
    if name == "sentencepiece":
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        # sentencepiece splits on nothing but marks word starts with "▁", the text's first word too;
        # "\n" is a piece of its own (Llama's <0x0A>)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split("\n", behavior="isolated"),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")])
        tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet = [c for c in string.printable if c not in " \t\r\x0b\x0c"] + ["▁"]
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=BASE_SPECIALS, initial_alphabet=alphabet,
                                      show_progress=False)
    elif name == "byte_level":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=BASE_SPECIALS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    else:
        raise ValueError(f"no fixture tokenizer {name!r}; there are {TOKENIZERS}")
    tokenizer.train_from_iterator(training_texts(), trainer)
    return tokenizer.to_str()


def tokenizer(name: str):
    """A fresh PreTrainedTokenizerFast of the fixture kind `name` (one of TOKENIZERS)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(name)), bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False, model_max_length=1 << 30)


def template(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text()


def with_template(name: str, family: str):
    """Tokenizer `name` as model family `family` has it: its chat template, special tokens, BOS, EOS."""
    spec = index()[family]
    tok = tokenizer(name)
    specials = {"additional_special_tokens": spec["special_tokens"], "eos_token": spec["eos_token"]}
    if spec["bos_token"]:
        specials["bos_token"] = spec["bos_token"]
    tok.add_special_tokens(specials)
    if not spec["bos_token"]:
        tok.bos_token = None
    tok.chat_template = template(family)
    return tok


def stop_ids(tok, family: str) -> set[int]:
    """Token ids that end a reply under `family`: its end-of-turn markers, and EOS."""
    markers = index()[family]["end_of_turn"] or []
    markers = [markers] if isinstance(markers, str) else markers
    return {tok.convert_tokens_to_ids(marker) for marker in markers} | {tok.eos_token_id}


# ---------------------------------------------------------------------------------------------------
# Rows with a tool call and its result, in OpenAI's layout (arguments as JSON text, as files hold them)

TOOLS = [{"type": "function", "function": {"name": "largest_of", "description": "The largest of some numbers.",
                                             "parameters": {"type": "object", "required": ["numbers"],
                                                            "properties": {"numbers": {"type": "array"}}}}}]


def tool_rows(count: int, seed: int = 0) -> list[dict]:
    """`count` rows: a user asks, the assistant calls `largest_of`, the tool answers, the assistant replies."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        numbers = [rng.randint(0, 99) for _ in range(rng.randint(2, 6))]
        call = {"id": f"call{rng.randint(0, 999)}", "type": "function",
                "function": {"name": "largest_of", "arguments": json.dumps({"numbers": numbers})}}
        messages = [{"role": "user", "content": f"Which is the largest of {' '.join(map(str, numbers))}?"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"largest": max(numbers)})},
                    {"role": "assistant", "content": f"The largest is {max(numbers)}."}]
        rows.append({"messages": messages, "tools": json.dumps(TOOLS)})
    return rows
