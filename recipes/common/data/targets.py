"""Which tokens of a row are trained: the row rendered once, as the model sees it at inference,
tokenised once (a whole batch of rows in one call of the fast tokenizer), and its targets found as
character spans of the rendering.

Chat rows are rendered with the chat template twice: as they are, and with each trained reply's
text replaced by a marker. What lies between the markers is the template's own text, so aligning
the two renderings finds every reply in the real one, also under templates that re-render earlier
turns (Qwen3 drops old reasoning, Phi-3 ends the conversation with EOS, GPT-OSS ends the last reply
with another marker). A reply's targets run from where the model starts writing (the end of the
template's generation prompt) through its text to the first special token the template puts after
it: its end-of-turn marker. Where the template puts none there, EOS is added after the reply.

Plain rows (instruction, prompt / completion, text) are prompt + target as one text, tokenised as
`tokenizer(text)` tokenises it; the tokens after the prompt's characters are targets, then EOS.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..refusal import refuse
from .formats import (
    DEFAULT_CHAT_TEMPLATE,
    IGNORE,
    TURN_EXTRAS,
    RowProblem,
    conversation,
    conversation_problem,
    is_reply,
    places,
    row_problem,
    split_prompt,
    tools_of,
    with_parts,
    without_parts,
)

# Private-use characters: no template writes them and no row is expected to hold them.
MARK_OPEN, MARK_CLOSE = "\ue000", "\ue001"
MARKER = re.compile(f"{MARK_OPEN}(\\d+){MARK_CLOSE}")
PROBE_USER = "\ue002"


@dataclass
class Rendering:
    """One row as text, the character spans it trains on, and what the data line reports."""
    text: str
    spans: list[tuple[int, int]]
    plain: bool = False             # tokenised with the tokenizer's own special tokens (BOS), EOS appended
    eos_added: int = 0              # replies after which EOS was added (the template ends none)
    stops: list[str] = field(default_factory=list)  # the stop signal of each reply
    boundary: bool = False          # a token holds the prompt's last and the target's first characters


class ChatTemplate:
    """The tokenizer's chat template (the default one where it has none), with what is needed to find
    the replies in its renderings: its special tokens and the text a reply opens with."""

    def __init__(self, tokenizer, images: bool = False):
        self.tokenizer = tokenizer
        self.images = images  # a vision-language model's rows: every turn's content given as a list of parts
        self.template = tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
        specials = {token for token in tokenizer.all_special_tokens if token}
        specials |= {added.content for added in tokenizer.added_tokens_decoder.values() if added.special and added.content}
        self.special = re.compile("|".join(re.escape(token) for token in sorted(specials, key=len, reverse=True))) \
            if specials else None
        self.opening = self._opening()
        self.opening_specials = set(self.special.findall(self.opening)) if self.special else set()

    def render(self, messages: list[dict], generation_prompt: bool = False, tools: list | None = None) -> str:
        if self.images:
            messages = [with_parts(message) for message in messages]
        elif any("parts" in message for message in messages):
            messages = [without_parts(message) for message in messages]
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as error:  # a template that raises on some rows (alternation, no system role)
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise RowProblem(f"the chat template refuses it: {reason[:80]}") from error

    def _opening(self) -> str:
        """What the model writes after the generation prompt and before a reply's text (GPT-OSS:
        `<|channel|>final<|message|>`; usually nothing): part of the targets."""
        try:
            asked = self.render([{"role": "user", "content": PROBE_USER}], generation_prompt=True)
            answered = self.render([{"role": "user", "content": PROBE_USER},
                                    {"role": "assistant", "content": MARK_OPEN + "0" + MARK_CLOSE}])
        except RowProblem:
            return ""
        mark = answered.find(MARK_OPEN)
        start = common_prefix_length(asked, answered)
        return answered[start:mark] if 0 <= start <= mark else ""

    def end_marker(self, text: str, start: int, calls_only: bool = False):
        """The first special token after `start` that ends a reply (its end-of-turn marker), or None. The
        special tokens a reply opens with are part of it: those of the template's opening (GPT-OSS's
        `<|channel|>`, `<|message|>`), and for a reply that only calls a tool, those before the call's
        text (Mistral's `[TOOL_CALLS]`)."""
        for match in self.special.finditer(text, start) if self.special else ():
            if match.group() in self.opening_specials or (calls_only and not text[start:match.start()].strip()):
                continue
            return match
        return None


def common_prefix_length(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share (bisection over C-speed slice comparisons)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _marked(turns: list[dict], replies: list[int], only: int | None = None) -> list[dict]:
    marked = [dict(turn) for turn in turns]
    for k, i in enumerate(replies):
        if only is None or k == only:
            marked[i]["content"] = f"{MARK_OPEN}{k}{MARK_CLOSE}"
            marked[i].pop("parts", None)
    return marked


def _regions_by_alignment(text: str, marked: str, count: int):
    """Each reply's (start, end) in `text`, by matching the template's text between the markers of
    `marked` (one rendering with every reply marked); None when the template's own text changed."""
    pieces = MARKER.split(marked)  # [between_0, "0", between_1, "1", ..., between_n]
    if len(pieces) != 2 * count + 1 or pieces[1::2] != [str(k) for k in range(count)]:
        return None
    between = pieces[0::2]
    if not text.startswith(between[0]):
        return None
    regions, position = [], len(between[0])
    for k in range(count):
        follows = between[k + 1]
        if k == count - 1:
            end = len(text) - len(follows)
            if not text.endswith(follows) or end < position:
                return None
        else:
            end = text.find(follows, position)
            if end < 0 or not follows:
                return None
        regions.append((position, end))
        position = end + len(follows)
    return regions


def render_chat(turns: list[dict], chat: ChatTemplate, tools: list | None = None) -> Rendering:
    """The conversation rendered once, with each trained reply's span (opening, text, stop signal).

    A reply with text is found by its marker (see the module's docstring). A reply that only calls a
    tool has no text to mark (and templates write such a turn differently): it starts where the model
    starts writing and ends at the first special token after the call.
    """
    messages = [{"role": turn["role"], "content": turn["content"],
                 **{key: turn[key] for key in (*TURN_EXTRAS, "parts") if key in turn}} for turn in turns]
    replies = [i for i in range(len(turns)) if is_reply(turns, i)]
    with_text = [i for i in replies if messages[i]["content"].strip() or not messages[i].get("tool_calls")]

    def render(conversation, generation_prompt=False):
        return chat.render(conversation, generation_prompt, tools)

    def writing_starts(i: int) -> int:  # where the model starts writing reply i: the generation prompt's end
        return common_prefix_length(text, render(messages[:i], True))

    text = render(messages)
    regions = _regions_by_alignment(text, render(_marked(messages, with_text)), len(with_text))
    if regions is not None:
        regions = [(start - len(chat.opening) if chat.opening and text[max(0, start - len(chat.opening)):start] == chat.opening
                    else start, end) for start, end in regions]
    else:  # the template renders around a reply differently when its text changes: one reply at a time
        regions = []
        for k, i in enumerate(with_text):
            before, found, follows = render(_marked(messages, with_text, only=k)).partition(f"{MARK_OPEN}{k}{MARK_CLOSE}")
            if not found:
                raise RowProblem("the chat template leaves the reply out of its rendering")
            start, end = min(common_prefix_length(text, before), writing_starts(i)), len(text) - len(follows)
            if not text.endswith(follows) or start > end or (regions and start < regions[-1][1]):
                raise RowProblem("the chat template renders the rest of the conversation differently for each "
                                 "reply's text, so the reply cannot be found in the rendering")
            regions.append((start, end))
    located = dict(zip(with_text, regions))
    eos = chat.tokenizer.eos_token
    pieces, spans, stops, eos_added, copied, shift = [], [], [], 0, 0, 0
    for i in replies:
        calls_only = i not in located
        start, end = (writing_starts(i),) * 2 if calls_only else located[i]
        if spans and start + shift < spans[-1][1]:
            raise RowProblem("the chat template renders the replies out of order, so they cannot be found")
        stop = chat.end_marker(text, end, calls_only)
        next_text = str(messages[i + 1]["content"]).strip() if i + 1 < len(messages) else ""
        if stop is not None and next_text and next_text in text[end:stop.start()]:
            stop = None  # the next turn began before that token: it is not this reply's end
        if calls_only and stop is not None and not all(name in text[start:stop.start()] for name in called(messages[i])):
            raise RowProblem("the chat template leaves the tool call out of its rendering")
        if stop is not None:
            spans.append((start + shift, stop.end() + shift))
            stops.append(stop.group())
        elif calls_only:
            raise RowProblem("the chat template ends a tool call with no special token")
        elif eos:
            pieces += [text[copied:end], eos]
            copied = end
            spans.append((start + shift, end + shift + len(eos)))
            shift += len(eos)
            stops.append(eos)
            eos_added += 1
        else:
            spans.append((start + shift, end + shift))
            stops.append("")
    return Rendering("".join(pieces) + text[copied:], spans, eos_added=eos_added, stops=stops)


def called(turn: dict) -> list[str]:
    """The names of the functions a turn calls."""
    return [call["function"]["name"] for call in turn.get("tool_calls") or []
            if isinstance(call, dict) and isinstance(call.get("function"), dict) and isinstance(call["function"].get("name"), str)]


def render_plain(row: dict, fmt: str) -> Rendering:
    prompt, target = split_prompt(row, fmt)
    prompt = prompt or ""
    return Rendering(prompt + target, [(len(prompt), len(prompt) + len(target))], plain=True)


def trained_mask(offsets, spans) -> np.ndarray:
    """Which tokens (character offsets [start, end)) overlap a trained span."""
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), dtype=bool)
    for start, end in spans:
        mask |= (ends > start) & (starts < end)
    return mask


def require_offsets(tokenizer) -> None:
    """Refuse a tokenizer that cannot give character offsets (not a fast, Rust one)."""
    if not getattr(tokenizer, "is_fast", False):
        refuse(f"the tokenizer ({type(tokenizer).__name__}) is not a fast (Rust) tokenizer, which the data path "
               "needs for character offsets; give a model folder with a tokenizer.json")


def tokenize_rows(rows: list[dict], tokenizer, fmt: str, images: bool = False) -> list[dict]:
    """Each row as {input_ids, labels, problem ("" or why it cannot train), eos_added, stops (its replies'
    stop signals), boundary, text (the rendering), places (how many images its turns place)},
    all rows tokenised in one call. With `images` (a vision-language model's rows), each turn's content is
    given to the chat template as a list of parts, an image's part where the row has it (images.py); the
    rendering's image placeholders are then one token each, which the processor expands as it collates."""
    require_offsets(tokenizer)
    chat = ChatTemplate(tokenizer, images) if fmt == "messages" else None
    renderings: list[Rendering | str] = []
    placed = []  # the images each row's turns place (counted for image rows only)
    for row in rows:
        turns = conversation(row["messages"]) if chat else None  # the cell read once, for the check and the rendering
        placed.append(places(turns) if images and turns else 0)
        problem = conversation_problem(turns) if chat else row_problem(row, fmt)
        if problem is None:
            try:
                renderings.append(render_chat(turns, chat, tools_of(row)) if chat else render_plain(row, fmt))
                continue
            except RowProblem as error:
                problem = str(error)
        renderings.append(problem)
    texts = [r.text for r in renderings if isinstance(r, Rendering)]
    encodings = iter(encode(tokenizer, texts, special_tokens=fmt != "messages"))
    eos_id = tokenizer.eos_token_id
    out = []
    for rendering, count in zip(renderings, placed):
        if not isinstance(rendering, Rendering):
            out.append({"input_ids": NO_TOKENS, "labels": NO_TOKENS, "problem": rendering, "eos_added": 0, "stops": [],
                        "boundary": False, "text": "", "places": count})
            continue
        encoding = next(encodings)
        ids = np.array(encoding.ids, dtype=np.int32)
        offsets = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        if rendering.plain:
            if len(ids) and ids[-1] == eos_id and not offsets[-1].any():  # the tokenizer's own EOS: trained below
                ids, offsets = ids[:-1], offsets[:-1]
            cut = rendering.spans[0][0]  # a plain row's one span starts where its prompt ends
            rendering.boundary = cut > 0 and bool(((offsets[:, 0] < cut) & (cut < offsets[:, 1])).any())
        labels = np.where(trained_mask(offsets, rendering.spans), ids, IGNORE).astype(np.int32)
        if rendering.plain and eos_id is not None:
            ids, labels = np.append(ids, np.int32(eos_id)), np.append(labels, np.int32(eos_id))
        out.append({"input_ids": ids, "labels": labels, "problem": "", "eos_added": rendering.eos_added,
                    "stops": [stop for stop in dict.fromkeys(rendering.stops) if stop], "boundary": rendering.boundary,
                    "text": rendering.text, "places": count})
    return out


NO_TOKENS = np.zeros(0, dtype=np.int32)


def encode(tokenizer, texts: list[str], special_tokens: bool) -> list:
    """The Rust tokenizer's encodings of `texts` (ids and character offsets), in one batched call, as
    `tokenizer(texts, return_offsets_mapping=True)` makes them: its backend called directly, because
    transformers would first copy every encoding into Python lists (a third of the time)."""
    if not texts:
        return []
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None or backend.padding is not None:  # whole rows, unpadded (transformers
        backend.no_truncation()  # clears these before each of its own calls too)
        backend.no_padding()
    return backend.encode_batch(texts, add_special_tokens=special_tokens)


def tokenize_row(row: dict, tokenizer, fmt: str, max_length: int | None = None, images: bool = False) -> dict:
    """input_ids and labels of one row, cut to `max_length` tokens (None: uncut); RowProblem when it
    cannot train. `images`: a vision-language model's row (tokenize_rows)."""
    (one,) = tokenize_rows([row], tokenizer, fmt, images)
    if one["problem"]:
        raise RowProblem(one["problem"])
    return {"input_ids": one["input_ids"][:max_length].tolist(), "labels": one["labels"][:max_length].tolist()}
