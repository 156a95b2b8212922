"""What rows train on under model families' published chat templates and real kinds of tokenizer.

Every fixture template (tests/fixtures/chat_templates/) x every fixture tokenizer (bundled
character-level, sentencepiece-style, byte-level BPE; tests/chat_fixtures.py), over generated
multi-turn rows (1-3 turns, about half with a system prompt), through the recipes' own
`tokens.tokenize_counted`. The properties:

  inference_ids    a kept row's input_ids are `apply_chat_template(messages, tokenize=True)`, the
                   ids the model sees at inference (under a template that ends no reply, with the EOS
                   the model is taught to stop with after each reply);
  replies_trained  each trained assistant reply is one run of targets that holds the reply's text;
  prompts_masked   no user or system text is inside the targets;
  stop_signal      the last target of each reply is a stop signal (the template's end-of-turn marker,
                   or EOS);
  rows_kept        no row is dropped that its template can render.

Then the same for plain rows (instruction, prompt / completion) under the three tokenizers, and for
Qwen3 rows whose replies carry their reasoning.
"""

from __future__ import annotations

import functools
import sys

import pytest

import chat_fixtures as fixtures
from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
from common.data import batches, formats, tokens  # noqa: E402

ROWS = 24  # per case; seeded, so every run checks the same rows
PROPERTIES = ("inference_ids", "replies_trained", "prompts_masked", "stop_signal", "rows_kept")


def inference_ids(tok, family: str, messages: list[dict]) -> list[int]:
    """The ids a model of `family` sees for `messages` at inference; a template that renders nothing
    after a reply gets the EOS the model is taught to stop with."""
    if fixtures.index()[family]["end_of_turn"] is None:
        turns = formats.conversation(messages)
        messages = [dict(message, content=message["content"] + tok.eos_token) if formats.is_reply(turns, i)
                    else message for i, message in enumerate(messages)]
    return tok.apply_chat_template(messages, tokenize=True)["input_ids"]


@functools.lru_cache(maxsize=None)
def prepared(family: str, tokenizer_name: str):
    """(tokenizer, rows, tokenised rows) of one case, through the recipes' tokenize_counted."""
    import datasets

    datasets.disable_progress_bars()
    tok = fixtures.with_template(tokenizer_name, family)
    rows = fixtures.chat_rows(ROWS, seed=7)
    tokenized, fmt = tokens.tokenize_counted(datasets.Dataset.from_list(rows), tok, 1 << 16)
    assert fmt == "messages"
    return tok, rows, list(tokenized)


def renders(tok, messages) -> bool:
    try:
        tok.apply_chat_template(messages, tokenize=False)
    except Exception:  # the template refuses the conversation (a system turn, roles that do not alternate)
        return False
    return True


def target_runs(row: dict) -> list[list[int]]:
    """The maximal runs of consecutive trained tokens, in order."""
    runs, current = [], []
    for token, label in zip(row["input_ids"], row["labels"]):
        if label != batches.IGNORE:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def kept(family: str, tokenizer_name: str):
    tok, rows, tokenized = prepared(family, tokenizer_name)
    pairs = [(row, out) for row, out in zip(rows, tokenized) if not out["dropped"]]
    reasons = sorted({out["dropped"] for out in tokenized if out["dropped"]})
    assert pairs, f"nothing to check: every row dropped ({'; '.join(reasons)})"
    return tok, pairs


def check(family: str, tokenizer_name: str, prop: str) -> None:
    if prop == "rows_kept":
        tok, rows, tokenized = prepared(family, tokenizer_name)
        lost = [(i, out["dropped"]) for i, (row, out) in enumerate(zip(rows, tokenized))
                if out["dropped"] and renders(tok, row["messages"])]
        assert not lost, f"{len(lost)} of {len(rows)} rows the template renders were dropped, e.g. row {lost[0][0]}: {lost[0][1]}"
        return
    tok, pairs = kept(family, tokenizer_name)
    for row, out in pairs:
        messages = row["messages"]
        if prop == "inference_ids":
            expected = inference_ids(tok, family, messages)
            if out["input_ids"] != expected:
                at = next((i for i, (a, b) in enumerate(zip(out["input_ids"], expected)) if a != b),
                          min(len(expected), len(out["input_ids"])))
                shown = lambda ids: tok.convert_ids_to_tokens(ids[max(0, at - 4):at + 4])  # noqa: E731
                raise AssertionError(f"trained ids differ from inference's from token {at}: "
                                     f"trained {shown(out['input_ids'])}, inference {shown(expected)}")
            continue
        runs = target_runs(out)
        texts = [tok.decode(run) for run in runs]
        turns = formats.conversation(messages)
        replies = [turn["content"] for i, turn in enumerate(turns) if formats.is_reply(turns, i)]
        if prop == "replies_trained":
            assert len(runs) == len(replies), f"{len(replies)} replies but {len(runs)} target runs: {texts}"
            for reply, text in zip(replies, texts):
                assert reply in text, f"reply {reply!r} is not in its targets {text!r}"
        elif prop == "prompts_masked":
            prompts = [turn["content"] for turn in turns if turn["role"] in ("user", "system")]
            for text in texts:
                assert not [p for p in prompts if p in text], f"prompt text trained: {text!r}"
        elif prop == "stop_signal":
            stops = fixtures.stop_ids(tok, family)
            for run, text in zip(runs, texts):
                assert run[-1] in stops, (f"the reply's targets end with {tok.convert_ids_to_tokens(run[-1:])}, "
                                          f"not a stop signal: {text!r}")


CASES = [pytest.param(family, name, prop, id=f"{family}-{name}-{prop}")
         for family in fixtures.FAMILIES for name in fixtures.TOKENIZERS for prop in PROPERTIES]


@pytest.mark.parametrize("family, tokenizer_name, prop", CASES)
def test_chat_rows_train_on_what_inference_sees(family, tokenizer_name, prop):
    check(family, tokenizer_name, prop)


@pytest.mark.parametrize("family", fixtures.FAMILIES)
@pytest.mark.parametrize("tokenizer_name", fixtures.TOKENIZERS)
def test_every_fixture_template_renders_on_every_fixture_tokenizer(family, tokenizer_name):
    """Rows without a system prompt render under every template (Mistral's refuses a system turn), the
    template's special tokens stay whole, and the rendering starts with BOS only where the template
    puts one."""
    tok = fixtures.with_template(tokenizer_name, family)
    spec = fixtures.index()[family]
    rows = [row for row in fixtures.chat_rows(ROWS, seed=7) if row["messages"][0]["role"] != "system"]
    assert rows
    for row in rows:
        ids = tok.apply_chat_template(row["messages"], tokenize=True)["input_ids"]
        tokens = tok.convert_ids_to_tokens(ids)
        for special in spec["special_tokens"]:
            if special in tok.decode(ids):
                assert special in tokens, f"{special} is split into pieces"
        markers = spec["end_of_turn"] or []
        for marker in [markers] if isinstance(markers, str) else markers:
            assert tok.convert_tokens_to_ids(marker) != tok.unk_token_id


def test_the_template_index_names_a_source_for_every_template():
    spec = fixtures.index()
    files = {path.stem for path in fixtures.TEMPLATES.glob("*.jinja")}
    assert files == set(spec)
    assert {"qwen3", "phi3", "deepseek_r1_distill", "gpt_oss", "llama3_1", "gemma3", "mistral_instruct"} <= files
    assert any(entry["end_of_turn"] is None for entry in spec.values())  # one family renders no end-of-turn marker
    for entry in spec.values():
        assert entry["source"] and entry["model"] and entry["family"]
    assert sum(path.stat().st_size for path in fixtures.TEMPLATES.iterdir()) < 100_000
