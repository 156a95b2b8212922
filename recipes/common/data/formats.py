"""The row formats: how each is recognised, read and checked (targets.py makes tokens of them).

Formats, detected from the columns:
  messages                                chat turns rendered with the tokenizer's chat template
                                          (a plain default when it has none); assistant turns are
                                          the targets
  instruction [+ input] + output|response the response is the target, the prompt is masked
  prompt + completion                     the completion is the target
  text                                    plain language modelling, every token is a target
"""

from __future__ import annotations

import json

from ..refusal import refuse

IGNORE = -100  # label of a token that is not a target (prompt, padding)
PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
PROMPT_WITH_INPUT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
# For tokenizers without a chat template: BOS, one header line per turn (tool calls as JSON after the
# text), EOS closes an assistant turn.
DEFAULT_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['tool_calls'] %}{{ message['tool_calls'] | tojson }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Opens the template of a processor that lays its prompt out itself (PaliGemma's: `prefix_template`)
PREFIX_LAYOUT = "{#- the processor's own layout: the images, BOS, the prompt and a newline; the reply and EOS -#}"


def lays_out_prompt(processor) -> bool:
    """Whether the processor lays a prompt out itself and takes the reply apart, as `suffix`: PaliGemma's writes the
    images' tokens, BOS, the prompt and "\\n", then the suffix and EOS, and marks the suffix in `token_type_ids`. Its
    rows are rendered in that layout (`prefix_template`: what the loss sees is what the model reads at inference)
    and given back to it split into prompt and suffix (images.prompt_and_suffix)."""
    import inspect

    return "suffix" in inspect.signature(processor.__call__).parameters


def prefix_template(image_token: str) -> str:
    """The chat template of a processor that lays its prompt out itself (`lays_out_prompt`), for a model with
    none of its own (PaliGemma's checkpoints): the processor's layout of one user turn and the reply, the turn's
    images first (a placeholder each), BOS, its text and "\\n"; the reply and EOS after it, the reply's part trained."""
    text_of = ("{%- macro text_of(content) -%}{%- if content is string -%}{{ content }}{%- else -%}"
               "{%- for part in content if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
               "{%- endif -%}{%- endmacro -%}")
    return (PREFIX_LAYOUT + text_of +
            "{%- if messages[0]['role'] != 'user' or messages | length > 2 or (messages | length == 2 and "
            "messages[1]['role'] != 'assistant') -%}{{ raise_exception('the model reads one prompt and one reply: a "
            "user turn, then an assistant turn') }}{%- endif -%}"
            "{%- if messages[0]['content'] is string or not (messages[0]['content'] | selectattr('type', 'equalto', "
            "'image') | list) -%}{{ raise_exception('the model reads an image in every prompt: this row has none') }}"
            "{%- endif -%}"
            "{%- if messages[0]['content'] is not string -%}{%- for part in messages[0]['content'] "
            "if part['type'] == 'image' -%}{{ '" + image_token + "' }}{%- endfor -%}{%- endif -%}"
            "{{ bos_token + text_of(messages[0]['content']) + '\\n' }}"
            "{%- if messages | length == 2 -%}{% generation %}{{ text_of(messages[1]['content']) + eos_token }}"
            "{% endgeneration %}{%- endif -%}")


# GRPO's prompt formats (data/prompts.py), and the supervised format whose rendering each shares (pairs.row_formats:
# how a run is scored)
TEXT_PROMPTS, CHAT_PROMPTS = "prompts", "chat prompts"
PROMPT_FORMATS = {TEXT_PROMPTS: "text", CHAT_PROMPTS: "messages"}
PROMPT_IDS = "prompt_ids"  # a prompt's tokens, beside the dataset's own columns


def reward_columns(rows) -> list[str]:
    """The columns the reward functions receive as keyword lists (all but the prompt and its tokens)."""
    return [name for name in rows.column_names if name not in ("prompt", PROMPT_IDS)]


def chat_template_line(accelerator, tokenizer, args, chat: bool) -> None:
    """Where the run has chat rows: which template renders them, printed once beside the data lines (the
    tokenizer saved with the model carries it, so generate.py and a reload see the run's rendering)."""
    if not chat or not accelerator.is_main_process:
        return
    if args.chat_template:
        which = f"--chat-template {args.chat_template}"
    elif tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE:
        which = (f"the plain default (`<|user|>` / `<|assistant|>` turns), as {args.model}'s tokenizer has none "
                 "(--chat-template FILE for another)")
    elif (tokenizer.chat_template or "").startswith(PREFIX_LAYOUT):
        which = f"{args.model}'s processor's own layout (the images, BOS, the prompt and a newline; then the reply)"
    else:
        which = f"{args.model}'s own chat template"
    print(f"data: chat rows rendered with {which}; the tokenizer saved with the model carries it", flush=True)


def shortened(text: str, keep: int = 120) -> str:
    """`text` for a console line: whole when it has at most `keep` characters, else its start and its end cut at
    word boundaries around how long it is in all (samples.jsonl and run.json keep texts whole)."""
    if len(text) <= keep:
        return text
    head, tail = text[:keep // 2], text[-(keep // 2):]
    head = head[:head.rfind(" ")] if " " in head.strip() else head  # no word cut in two
    tail = tail[tail.find(" ") + 1:] if " " in tail.strip() else tail
    return f"{head} [... {len(text):,} characters in all ...] {tail}"


def detect_format(columns) -> str:
    columns = set(columns)
    if "messages" in columns:
        return "messages"
    if "instruction" in columns and ({"output", "response"} & columns):
        return "instruction"
    if {"prompt", "completion"} <= columns:
        return "prompt_completion"
    if "text" in columns:
        return "text"
    if {"chosen", "rejected"} <= columns:  # preference pairs given to a supervised recipe
        refuse(f"these rows are preference pairs (found {sorted(columns)}): train them with recipes/dpo.py (DPO, IPO, "
               "SimPO, ORPO) or reward.py (a reward model); the supervised recipes take `messages`, `text`, "
               "`instruction` + `output`/`response`, or `prompt` + `completion`")
    refuse(f"the dataset has no usable text columns (found {sorted(columns)}); expected `messages`, `text`, "
           "`instruction` + `output`/`response`, or `prompt` + `completion` (map yours with --columns)")


class RowProblem(ValueError):
    """A row that cannot be trained on; it is dropped and counted under this message."""


ROLES = ("system", "user", "assistant")
# columns that must hold text (or be empty) in each format
TEXT_COLUMNS = ("instruction", "input", "output", "response", "prompt", "completion", "text")
# the columns each format reads, and the one every row of the format has
# Preference pairs (pairs.py reads them), for DPO: TRL's explicit prompt (`prompt`, `chosen`, `rejected`) or
# implicit one (the start `chosen` and `rejected` share), each as text or as chat messages
PAIRS_TEXT, PAIRS_CONVERSATIONAL = "preference pairs, text", "preference pairs, conversational"
PAIRS_IMPLICIT_TEXT, PAIRS_IMPLICIT_CONVERSATIONAL = f"{PAIRS_TEXT}, implicit prompt", f"{PAIRS_CONVERSATIONAL}, implicit prompt"
# Judged replies (feedback.py reads them), for KTO: TRL's unpaired preference rows (`prompt`, `completion`, `label`:
# true for a reply to learn from, false for one to avoid), as text or as chat messages
FEEDBACK_TEXT, FEEDBACK_CONVERSATIONAL = "judged replies, text", "judged replies, conversational"
READ_COLUMNS = {"messages": ("messages", "tools", "images", "image", "row_in_file"), "instruction": ("instruction", "input", "output", "response"),
                "prompt_completion": ("prompt", "completion"), "text": ("text",),
                PAIRS_TEXT: ("prompt", "chosen", "rejected", "margin"),
                PAIRS_CONVERSATIONAL: ("prompt", "chosen", "rejected", "tools", "margin", "images", "image", "row_in_file"),
                PAIRS_IMPLICIT_TEXT: ("chosen", "rejected", "margin"),
                PAIRS_IMPLICIT_CONVERSATIONAL: ("chosen", "rejected", "tools", "margin", "images", "image",
                                                "row_in_file"),
                FEEDBACK_TEXT: ("prompt", "completion", "label"),
                FEEDBACK_CONVERSATIONAL: ("messages", "label", "tools")}
FORMAT_KEYS = {"messages": "messages", "instruction": "instruction", "prompt_completion": "prompt", "text": "text"}


# ShareGPT's speakers, and other names datasets give the two sides (OpenAI's `developer` is its system role)
SPEAKERS = {"human": "user", "gpt": "assistant", "chatgpt": "assistant", "bot": "assistant", "model": "assistant",
            "developer": "system"}
TOOL_ROLES = ("tool", "function", "ipython")


# Keys of a turn that templates read besides role and content (tool calls, their results, reasoning).
TURN_EXTRAS = ("tool_calls", "tool_call_id", "name", "reasoning_content", "thinking")


def conversation(cell) -> list | None:
    """A `messages` cell as [{"role", "content", ...}, ...], also when written as ShareGPT's {"from", "value"},
    with the content as a list of parts ({"type": "text", "text": ...}; other parts are not text and are
    left out), with roles in capitals, or as a JSON string. None when it is no list of turns.
    OpenAI's fine-tuning `"weight": 0` on an assistant turn (keep it as context, do not train on it) is
    kept, and so are the keys templates read for tool calls, tool results and reasoning (TURN_EXTRAS)."""
    cell = json_value(cell)
    if not isinstance(cell, list):
        return None
    turns = []
    for turn in cell:
        if not isinstance(turn, dict):
            return None
        role = turn.get("role") or turn.get("from")
        content = turn.get("content") if turn.get("content") is not None else turn.get("value")
        images = turn.get("parts")  # a turn read here before (a preference pair's side): its parts as read
        if isinstance(content, list):
            images = image_parts(content)
            parts = [part if isinstance(part, str) else part.get("text") for part in content
                     if isinstance(part, str) or (isinstance(part, dict) and part.get("type", "text") == "text")]
            content = "".join(part for part in parts if isinstance(part, str)) if parts else "" if images else None
        role = SPEAKERS.get(str(role).lower(), str(role).lower()) if isinstance(role, str) else role
        extras = {key: turn[key] for key in TURN_EXTRAS if turn.get(key) is not None}  # datasets fills absent keys with None
        if turn.get("function_call") and "tool_calls" not in extras:  # OpenAI's older form of one call
            extras["tool_calls"] = [{"type": "function", "function": turn["function_call"]}]
        if "tool_calls" in extras:
            extras["tool_calls"] = without_nulls([dict(call, function=dict(call["function"], arguments=json_value(
                call["function"].get("arguments")))) if isinstance(call, dict) and isinstance(call.get("function"), dict)
                else call for call in json_value(extras["tool_calls"]) or []])
            content = "" if content is None else content  # a turn that only calls a tool
        if images:  # the content's parts in their order, images among the text (images.py renders them)
            extras["parts"] = images
        turns.append({"role": role, "content": content, "weight": turn.get("weight", 1), **extras})
    return turns


IMAGE_PART_TYPES = ("image", "image_url")
PLACEHOLDER = "<image>"  # an image's place in a turn's text (LLaVA, ShareGPT)


def image_parts(content: list) -> list | None:
    """A content list with images among its parts, as [{"type": "image"} | {"type": "text", "text": ...}] in their
    order; None when it holds no image (its text is the turn's content)."""
    if not any(isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES for part in content):
        return None
    return [{"type": "image"} if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
            else {"type": "text", "text": part if isinstance(part, str) else part.get("text") or ""}
            for part in content
            if isinstance(part, str) or (isinstance(part, dict) and part.get("type", "text") in ("text", *IMAGE_PART_TYPES))]


def with_parts(message: dict) -> dict:
    """A message for a vision-language model's chat template: its content as a list of parts, the images'
    parts where the row put them (`<image>` in the text read as one)."""
    message = dict(message)
    parts = message.pop("parts", None)
    if parts is None:
        parts = text_parts(message["content"])
    message["content"] = parts
    return message


def without_parts(message: dict) -> dict:
    message = dict(message)
    message.pop("parts", None)
    return message


def text_parts(text: str) -> list[dict]:
    """A turn's text as parts: an image's part for each `<image>`, the text around it as text parts."""
    pieces = text.split(PLACEHOLDER)
    parts = []
    for k, piece in enumerate(pieces):
        if k:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts or [{"type": "text", "text": ""}]


def places(turns: list[dict]) -> int:
    """How many images a conversation (as formats.conversation reads it) places."""
    count = 0
    for turn in turns:
        if "parts" in turn:
            count += sum(part["type"] == "image" for part in turn["parts"])
        elif isinstance(turn.get("content"), str):
            count += turn["content"].count(PLACEHOLDER)
    return count


def tools_of(row: dict) -> list | None:
    """The row's `tools` column (function schemas the template lists for the model), or None."""
    tools = without_nulls(json_value(row.get("tools")))
    return tools if isinstance(tools, list) and tools else None


def without_nulls(value):
    """`value` with the None entries of its dicts left out, at every depth: a dataset read from JSON
    gives every object of a column the keys of all of them, the absent ones None."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def json_value(value):
    """`value`, or what it holds when it is JSON text of a list or an object."""
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def row_problem(row: dict, fmt: str) -> str | None:
    """Why a row cannot be trained on (it is dropped and counted), or None when it can."""
    if fmt == "messages":
        return conversation_problem(conversation(row["messages"]))
    prompt_column = {"instruction": "instruction", "prompt_completion": "prompt"}.get(fmt)
    if prompt_column and not isinstance(row.get(prompt_column), str):
        return f"no {prompt_column}"
    target = split_prompt(row, fmt)[1]
    if not isinstance(target, str) or not target.strip():
        return "empty target"
    return None


def conversation_problem(turns: list | None) -> str | None:
    """Why a conversation (as `conversation` reads it) cannot be trained on, or None when it can."""
    if not turns:
        return "no messages"
    if any(not isinstance(turn["content"], str) for turn in turns):
        return "a turn without text"
    others = sorted({str(turn["role"]) for turn in turns if turn["role"] not in ROLES + TOOL_ROLES})
    if others:
        return f"a role other than {'/'.join(ROLES + TOOL_ROLES)} ({', '.join(others)})"
    if not any(is_reply(turns, i) and (turn["content"].strip() or turn.get("tool_calls"))
               for i, turn in enumerate(turns)):
        return "no assistant reply"
    return None


def is_reply(turns: list[dict], i: int) -> bool:
    """A trained turn: an assistant turn that answers a user (a greeting before the user spoke is
    context), not marked `"weight": 0`."""
    return (turns[i]["role"] == "assistant" and turns[i].get("weight", 1) != 0
            and any(turn["role"] == "user" for turn in turns[:i]))


def split_prompt(row: dict, fmt: str) -> tuple[str, str]:
    """(prompt, target) of one row; the prompt is not trained on."""
    if fmt == "instruction":
        target = row["output"] if row.get("output") is not None else row.get("response")
        template = PROMPT_WITH_INPUT_TEMPLATE if row.get("input") else PROMPT_TEMPLATE
        return template.format(instruction=row["instruction"], input=row.get("input", "")), target
    if fmt == "prompt_completion":
        return row["prompt"], row["completion"]
    return "", row["text"]


def filled_columns(dataset) -> list[str]:
    """The columns that hold something in some row (all of them when none does). Counted on the
    table beneath; only a column with some nulls in a selection of rows (a split) is looked at row
    by row."""
    table, rows = dataset.data, dataset._indices

    def filled(name: str) -> bool:
        column = table.column(name)
        if column.null_count in (0, len(table)) or rows is None:
            return column.null_count < len(table)
        return column.take(rows.column(0)).null_count < len(dataset)

    return [name for name in dataset.column_names if filled(name)] or dataset.column_names


def unread_columns(columns, fmt: str) -> str:
    """`; not read: category, context (...)` for the data line: columns the format leaves out, so that a
    column that matters (Dolly's `context`) does not vanish without a word."""
    unread = sorted(set(columns) - set(READ_COLUMNS[fmt]))
    if not unread:
        return ""
    hint = " (--columns input=context reads `context` as the input)" if (
        fmt == "instruction" and "context" in unread and "input" not in columns) else ""
    return f"; columns not read: {', '.join(unread)}{hint}"


def feature_name(feature) -> str:
    """What a column holds, for a refusal: `int64 values`, `list values`."""
    from datasets import Value

    return f"{feature.dtype} values" if isinstance(feature, Value) else f"{type(feature).__name__.lower()} values"


def first_row_lacking(table, key: str, other: str) -> int:
    """The first row (from 0) of a pyarrow table with no `key` but an `other`, or -1: a row of another format."""
    import pyarrow.compute as pc

    return pc.index(pc.and_(pc.is_null(table.column(key)), pc.is_valid(table.column(other))), True).as_py()


class DataFormat(str):
    """The training rows' (or pairs') format name (a str, which the recipes hand on to run.json as it is),
    carrying the system prompt the chat rows or conversational pairs were trained with (preparation's and
    preferences' `shared_system_prompt`), which run.json records too."""

    def __new__(cls, name: str, system_prompt: str | None = None):
        made = super().__new__(cls, name)
        made.system_prompt = system_prompt
        return made
