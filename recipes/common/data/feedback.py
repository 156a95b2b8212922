"""Judged replies as users have them (KTO's data) -> for each reply, a row of the supervised formats and its
label: true for a reply to learn from (desirable), false for one to avoid (undesirable). Each row is tokenised
exactly as a supervised row is (targets.py), its reply the only trained part.

Layouts, found from the columns (TRL's unpaired preference type):
  prompt + completion + label   the prompt and the reply: both text, or both chat messages (the file reader makes
                                these one `messages` conversation, the prompt's turns marked context: data_files.py);
                                `label` true / false
  messages + label              a conversation whose replies (assistant turns not marked `"weight": 0`) are judged
  chosen + rejected (+ prompt)  preference pairs (pairs.py), each read as two judged replies: its chosen one
                                desirable, its rejected one undesirable (TRL's unpair_preference_dataset)
"""

from __future__ import annotations

from ..refusal import refuse
from .formats import (
    FEEDBACK_CONVERSATIONAL,
    FEEDBACK_TEXT,
    conversation,
    conversation_problem,
    feature_name,
    filled_columns,
)
from .pairs import PAIR_FORMATS, holds_pairs, kind_of, pair_format_of, pair_sides

FEEDBACK_COLUMNS = ("prompt", "completion", "label")


def feedback_format_of(rows, spec: str) -> str:
    """The judged replies' format (a preference pairs' format for pairs), from the columns that hold something.
    Refused: rows without a `label` (supervised rows too), a label that is not true / false, a prompt and a
    completion of two kinds."""
    from datasets import Value

    if holds_pairs(rows):
        return pair_format_of(rows, spec)
    filled = filled_columns(rows)
    conversational = "messages" in filled
    missing = [name for name in (("messages", "label") if conversational else FEEDBACK_COLUMNS) if name not in filled]
    if missing:
        refuse(f"--dataset {spec} holds no judged replies: no `{'` or `'.join(missing)}` column (found "
               f"{sorted(filled)}); KTO needs rows of `prompt`, `completion` and `label` (true: a reply to learn "
               "from, false: one to avoid), or preference pairs (`chosen`, `rejected`); map yours with --columns, "
               "e.g. --columns completion=response,label=thumbs_up")
    label = rows.features["label"]
    if not (isinstance(label, Value) and label.dtype == "bool"):
        refuse(f"--dataset {spec}: column `label` holds {feature_name(label)}, not true / false; write each label "
               "as true (a reply to learn from) or false (one to avoid), e.g. JSON `\"label\": true`")
    if conversational:
        return FEEDBACK_CONVERSATIONAL
    kinds = {name: kind_of(rows.features[name], spec, name) for name in ("prompt", "completion")}
    if kinds["prompt"] != kinds["completion"]:  # (two message lists arrive as one conversation)
        refuse(f"--dataset {spec}: `prompt` holds {kinds['prompt']} and `completion` {kinds['completion']}; give "
               "both the same way (both text, or both chat messages)")
    return FEEDBACK_TEXT


def judged_replies(row: dict, fmt: str) -> list[tuple[dict, bool]] | str:
    """The row's replies as (supervised row, label): one for a judged reply, two for a pair (its chosen reply
    desirable, its rejected one undesirable); or why the row cannot train."""
    if fmt in PAIR_FORMATS:
        sides = pair_sides(row, fmt)
        return sides if isinstance(sides, str) else [(sides[0], True), (sides[1], False)]
    label = row.get("label")
    if not isinstance(label, bool):
        return "no label"
    if fmt == FEEDBACK_CONVERSATIONAL:
        reply = {"messages": conversation(row.get("messages")), "tools": row.get("tools")}
        problem = conversation_problem(reply["messages"])
        return problem if problem else [(reply, label)]
    prompt, completion = row.get("prompt"), row.get("completion")
    if not isinstance(prompt, str):
        return "no prompt"
    if not isinstance(completion, str) or not completion.strip():
        return "empty completion"
    return [({"prompt": prompt, "completion": completion}, label)]


def feedback_problem(row: dict, fmt: str) -> str | None:
    """Why a row cannot train (before tokenising), or None."""
    found = judged_replies(row, fmt)
    return found if isinstance(found, str) else None
