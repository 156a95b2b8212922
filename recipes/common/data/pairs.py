"""Preference pairs as users have them -> for each pair, two rows of the supervised formats that share
its prompt (chosen side: prompt + chosen reply; rejected side: prompt + rejected reply), so that each
side is tokenised exactly as a supervised row is (targets.py), its reply the only trained part.

Layouts, found from the columns (TRL's dataset types):
  prompt + chosen + rejected   explicit prompt: all text, or all chat messages (the prompt's turns are
                               context, the chosen / rejected turns the replies)
  chosen + rejected            implicit prompt: two whole conversations (or texts) whose shared start is
                               the prompt. UltraFeedback-binarized also has a `prompt` column of text
                               beside conversations that hold it: the conversations are read, not it.
                               Anthropic HH's text pairs ("\\n\\nHuman: ...\\n\\nAssistant: ...") are
                               read as text, the prompt through the last "\\n\\nAssistant:" they share: the
                               model learns the dialogue as the text it is, which is how a model trained
                               on HH is prompted; a chat template would change what it sees.

A pair whose replies are the same is dropped: its loss is constant (log 2 under DPO) and teaches nothing.
"""

from __future__ import annotations

import os

from ..refusal import refuse
from .formats import (
    FEEDBACK_CONVERSATIONAL,
    FEEDBACK_TEXT,
    PAIRS_CONVERSATIONAL,
    PAIRS_IMPLICIT_CONVERSATIONAL,
    PAIRS_IMPLICIT_TEXT,
    PAIRS_TEXT,
    PROMPT_FORMATS,
    conversation,
    conversation_problem,
    feature_name,
    filled_columns,
    first_row_lacking,
)

SIDES = ("chosen", "rejected")
# (conversational, explicit prompt) of each pair format
PAIR_FORMATS = {PAIRS_TEXT: (False, True), PAIRS_CONVERSATIONAL: (True, True),
                PAIRS_IMPLICIT_TEXT: (False, False), PAIRS_IMPLICIT_CONVERSATIONAL: (True, False)}
# KTO's judged replies (feedback.py): one reply a row, its prompt explicit; read as a pair's side is
FEEDBACK_FORMATS = {FEEDBACK_TEXT: (False, True), FEEDBACK_CONVERSATIONAL: (True, True)}
LAYOUTS = {**PAIR_FORMATS, **FEEDBACK_FORMATS}
SUPERVISED_ROWS = ("messages", "instruction", "text", "completion")  # a row of one of these is no pair
HH_REPLY_START = "\n\nAssistant:"


def holds_pairs(rows) -> bool:
    """Whether the rows are preference pairs (a `chosen` and a `rejected` column that hold something)."""
    return set(SIDES) <= set(filled_columns(rows))


def pair_format_of(rows, spec: str) -> str:
    """The pairs' format, from the columns that hold something. Refused: rows that are no pairs (the
    supervised formats), a column holding neither text nor messages, chosen and rejected of two kinds,
    and a file that mixes layouts (naming the first row of the second one)."""
    filled = filled_columns(rows)
    missing = [name for name in SIDES if name not in filled]
    if missing:
        refuse(f"--dataset {spec} holds no preference pairs: no `{'` or `'.join(missing)}` column (found "
               f"{sorted(filled)}); a preference dataset needs `chosen` and `rejected` (the preferred and the other "
               "reply, each text or chat messages), with `prompt` where they do not start with it; map yours with "
               "--columns, e.g. --columns chosen=good,rejected=bad")
    kinds = {name: kind_of(rows.features[name], spec, name) for name in ("prompt", *SIDES) if name in filled}
    if kinds["chosen"] != kinds["rejected"]:
        refuse(f"--dataset {spec}: `chosen` holds {kinds['chosen']} and `rejected` {kinds['rejected']}; give both "
               "replies the same way (both text, or both chat messages)")
    conversational, explicit = kinds["chosen"] == "messages", kinds.get("prompt") == kinds["chosen"]
    fmt = next(fmt for fmt, layout in PAIR_FORMATS.items() if layout == (conversational, explicit))
    table = rows.flatten_indices().data if rows._indices is not None else rows.data
    for other in [name for name in SUPERVISED_ROWS if name in filled]:
        row = first_row_lacking(table, "chosen", other)
        if row >= 0:
            refuse(f"--dataset {spec} mixes formats: its rows are preference pairs (`chosen`, `rejected`), but row "
                   f"{row + 1} has `{other}` and no `chosen`; keep one format per dataset (convert or remove those rows)")
    row = first_row_lacking(table, "prompt", "chosen") if explicit else -1
    if row >= 0:
        refuse(f"--dataset {spec} mixes formats: its pairs have a `prompt` ({fmt}), but row {row + 1} has none; "
               "give every pair its prompt, or none (the prompt is then the start chosen and rejected share)")
    return fmt


def kind_of(feature, spec: str, name: str) -> str:
    """"text" or "messages": what a pair's column holds; anything else is refused."""
    from datasets import Value

    if isinstance(feature, Value) and feature.dtype in ("string", "large_string"):
        return "text"
    turn = feature[0] if isinstance(feature, list) and feature else getattr(feature, "feature", None)
    if isinstance(turn, dict):
        return "messages"
    refuse(f"--dataset {spec}: column `{name}` holds {feature_name(feature)}, not text or chat messages; store it "
           "as text or as a list of {\"role\", \"content\"} turns (or map another column onto it with --columns)")


def side_format(fmt: str) -> str:
    """The supervised format of a pair's sides (of a judged reply)."""
    return "messages" if LAYOUTS[fmt][0] else "prompt_completion"


def row_formats(data_format: str) -> list[str]:
    """The supervised formats of a run's rows (run.json's data_format: a mixture's joined by "+"); preference
    pairs as their sides are, GRPO's prompts as the rows rendered the same way (chat prompts: chat rows)."""
    return [side_format(fmt) if fmt in LAYOUTS else PROMPT_FORMATS.get(fmt, fmt) for fmt in data_format.split("+")]


def renders_chat(data_format: str) -> bool:
    """Whether a run of `data_format` trained on rows rendered by the chat template (chat rows, chat pairs, or
    a mixture with them): its prompts are asked, and scored, the same way."""
    return "messages" in row_formats(data_format)


def pair_sides(row: dict, fmt: str) -> tuple[dict, dict] | str:
    """(chosen row, rejected row) in side_format(fmt), or why the pair cannot train."""
    conversational, explicit = PAIR_FORMATS[fmt]
    read = conversation if conversational else (lambda cell: cell if isinstance(cell, str) else None)
    chosen, rejected = read(row.get("chosen")), read(row.get("rejected"))
    for name, side in zip(SIDES, (chosen, rejected)):
        if side is None:
            return f"no {name} {'conversation' if conversational else 'text'}"
    if explicit:
        prompt = read(row.get("prompt"))
        if prompt is None:
            return "no prompt"
    else:
        prompt, chosen, rejected = (shared_turns if conversational else shared_text)(chosen, rejected)
        if not prompt:
            return "no shared prompt"
    if chosen == rejected:
        return "chosen and rejected are the same"
    if not conversational:
        for name, reply in zip(SIDES, (chosen, rejected)):
            if not reply.strip():
                return f"empty {name} reply"
        return {"prompt": prompt, "completion": chosen}, {"prompt": prompt, "completion": rejected}
    context = [dict(turn, weight=0) for turn in prompt]  # an assistant turn in the prompt is not trained
    sides = tuple({"messages": context + reply, "tools": row.get("tools")} for reply in (chosen, rejected))
    for name, side in zip(SIDES, sides):
        problem = conversation_problem(side["messages"])
        if problem:
            return f"{name}: {problem}"
    return sides


def pair_problem(row: dict, fmt: str) -> str | None:
    """Why a pair cannot train (before tokenising), or None."""
    found = pair_sides(row, fmt)
    return found if isinstance(found, str) else None


def opening_system_texts(rows, fmt: str, batch_rows: int = 1_000) -> set | None:
    """The texts of the system turns conversational pairs open with (their prompt's first turn; with an implicit
    prompt, the chosen conversation's); None when a pair opens with another turn; empty for text pairs. Read
    `batch_rows` pairs at a time (the rows are a selection over memory-mapped files), and no further once two
    texts differ. Judged replies (KTO's) as pairs with a prompt."""
    conversational, explicit = LAYOUTS[fmt]
    if not conversational:
        return set()
    column = "messages" if fmt in FEEDBACK_FORMATS else "prompt" if explicit else "chosen"
    found = set()
    for batch in rows.select_columns([column]).iter(batch_rows):
        for turns in map(conversation, batch[column]):
            if not turns:
                continue
            if turns[0]["role"] != "system" or not isinstance(turns[0]["content"], str):
                return None
            found.add(turns[0]["content"])
        if len(found) > 1:  # no one shared text: nothing more to learn
            break
    return found


def shared_turns(chosen: list, rejected: list) -> tuple[list, list, list]:
    """(prompt, chosen reply, rejected reply): the turns both conversations open with, and the rest."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def shared_text(chosen: str, rejected: str) -> tuple[str, str, str]:
    """(prompt, chosen reply, rejected reply) of two texts: in a Human/Assistant dialogue the prompt runs
    through the last "\\n\\nAssistant:" both hold; otherwise it ends before the word where they part (the
    space before that word starts the replies, as the tokenizers write " word")."""
    shared = os.path.commonprefix([chosen, rejected])
    turn = shared.rfind(HH_REPLY_START)
    if turn >= 0:
        cut = turn + len(HH_REPLY_START)
    else:
        cut = len(shared)
        while cut and not shared[cut - 1].isspace():
            cut -= 1
        if cut and shared[cut - 1] == " ":
            cut -= 1
    return chosen[:cut], chosen[cut:], rejected[cut:]
