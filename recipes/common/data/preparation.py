"""The data pipeline, stage by stage: files -> checked rows -> tokens and labels -> packed sequences.

Each stage is a module of its own (data_files.py and checked_rows.py, tokens.py, packing.py); the
micro-batches the training loop takes are batches.py's.
"""

from __future__ import annotations

from . import batches
from .checked_rows import load_sources
from ..refusal import refuse
from .formats import SPEAKERS, DataFormat, chat_template_line, conversation
from .images import ImageRows, image_rows, refuse_image_rows_without
from .packing import pack
from .pairs import renders_chat
from .targets import require_offsets
from .tokens import kept_rows, tokenize_counted, training_sets


def shared_system_prompt(parts) -> str | None:
    """The text of the system turn every chat row of the training sources opens with, when it is one text;
    None when a row opens without one, the rows' texts differ, or no source is chat. scripts/generate.py puts
    it before a prompt by default, so that the model is asked as it was trained."""
    found = set()
    for part in parts:
        if part.fmt == "messages":
            texts = opening_system_prompts(part.rows)
            if texts is None:
                return None
            found |= texts
    return found.pop() if len(found) == 1 else None


def opening_system_prompts(rows, batch_rows: int = 1_000) -> set | None:
    """The texts of the system turns the rows open with (empty rows left out); None when a row opens with
    another turn. Read `batch_rows` rows at a time (the rows are a selection over memory-mapped files: taking
    the whole column would copy every conversation into memory), and no further once two texts differ. Read
    in C where every turn is {role, content} text (or ShareGPT's {from, value}), else each cell as
    `conversation` reads it (JSON text, content in parts)."""
    keys = text_turn_keys(rows.data.schema.field("messages").type)
    found = set()
    for batch in rows.select_columns(["messages"]).with_format("arrow" if keys else None).iter(batch_rows):
        texts = first_system_texts(batch["messages"], keys)
        if texts is None:
            return None
        found |= texts
        if len(found) > 1:  # no one shared text: nothing more to learn
            break
    return found


def first_system_texts(column, keys: tuple[str, str] | None) -> set | None:
    """The texts of the system turns a batch of conversations opens with; None when one opens with another
    turn. `column`: Arrow lists of turns whose role and content are text under `keys`, or (keys None) cells
    as `conversation` reads them."""
    import pyarrow.compute as pc

    if keys is None:
        firsts = [turns[0] for turns in map(conversation, column) if turns]
        if any(turn["role"] != "system" or not isinstance(turn["content"], str) for turn in firsts):
            return None
        return {turn["content"] for turn in firsts}
    column = column.filter(pc.greater(pc.list_value_length(column), 0))
    first = pc.list_element(column, 0)
    roles = set(pc.unique(pc.utf8_lower(pc.struct_field(first, keys[0]))).to_pylist())
    texts = set(pc.unique(pc.struct_field(first, keys[1])).to_pylist())
    if {SPEAKERS.get(role, role) for role in roles} - {"system"} or None in texts:
        return None
    return texts


def text_turn_keys(column_type) -> tuple[str, str] | None:
    """(role key, content key) of a column of lists of turns whose role and content are text in one spelling
    each; None for any other column (then read row by row)."""
    import pyarrow as pa

    if not (pa.types.is_list(column_type) or pa.types.is_large_list(column_type)) or \
            not pa.types.is_struct(column_type.value_type):
        return None
    fields = {field.name: field.type for field in column_type.value_type}
    keys = [[name for name in spellings if name in fields] for spellings in (("role", "from"), ("content", "value"))]
    if any(len(found) != 1 for found in keys):
        return None
    role, content = keys[0][0], keys[1][0]
    texts = all(pa.types.is_string(fields[name]) or pa.types.is_large_string(fields[name]) for name in (role, content))
    return (role, content) if texts else None


def prepare(accelerator, tokenizer, args, launch, processor=None):
    """(train set, eval set, format name): read, checked and tokenised before the model loads.

    Every rank reads and checks the files itself, so a file that cannot be read is one line on
    every rank (with file:line), never a rank left waiting in a collective. Rank 0 tokenises first
    and the others reuse its cache. Rows that cannot train are dropped and counted; with no row
    left the run stops with the limit or the fix to change. Several --dataset sources are tokenised
    each on its own (each may have a format of its own), then drawn by their weights and joined.

    `processor` (a vision-language model's, processors.load): rows with images keep their rendering and
    their images' files, which the processor turns into the model's inputs a batch at a time (images.py).
    """
    train_parts, eval_parts = load_sources(args.dataset, args.seed, args.columns, getattr(args, "eval_dataset", None))
    require_offsets(tokenizer)  # on every rank, before rank 0 tokenises (in worker processes for a large set)
    refuse_image_rows_without(processor, train_parts + eval_parts, args.model)
    if args.packing and image_rows(train_parts + eval_parts):
        refuse("--packing does not keep a row's images with it; leave --packing out for rows with images")

    def tokenised(part):
        images = ImageRows(processor, part.name) if processor is not None else None
        return tokenize_counted(part.rows, tokenizer, args.max_length, images)[0]

    with accelerator.main_process_first():
        train_tokens = [tokenised(part) for part in train_parts]
        eval_tokens = [tokenised(part) for part in eval_parts]
    train_set, eval_set = training_sets(accelerator, args, train_parts, train_tokens, eval_parts, eval_tokens)
    data_format = DataFormat("+".join(sorted({part.fmt for part in train_parts})), shared_system_prompt(train_parts))
    chat_template_line(accelerator, tokenizer, args, renders_chat(data_format))
    if args.packing:
        with accelerator.main_process_first():  # rank 0 saves the packing plan, the others read it
            rows = len(train_set)
            train_set, fill = pack(train_set, args.max_length)
        if accelerator.is_main_process:
            # a packed micro-batch is --batch-size full-length sequences: its activations are those, not the rows'
            per_batch = args.batch_size * rows / max(len(train_set), 1)
            print(f"packing: {rows:,} training rows into {len(train_set):,} sequences of up to {args.max_length:,} "
                  f"tokens, {fill:.1%} full; a micro-batch of {args.batch_size} holds ~{per_batch:,.0f} rows "
                  f"(~{args.batch_size * fill * args.max_length:,.0f} tokens): the memory of {args.batch_size} full "
                  "sequences, so a smaller --batch-size keeps an unpacked run's", flush=True)
    batches.say_steps(accelerator, len(train_set), args, launch.data_parallel_size,
                      "sequences" if args.packing else "rows")
    return train_set, eval_set, data_format


def tokenize(dataset, tokenizer, max_length: int, packing: bool = False):
    """(tokenised dataset of the usable rows, format name); with `packing`, rows are packed into
    sequences of up to `max_length` tokens whose `position_ids` restart at every row."""
    tokenized, fmt = tokenize_counted(dataset, tokenizer, max_length)
    tokenized = kept_rows(tokenized)
    return (pack(tokenized, max_length)[0] if packing else tokenized), fmt
