"""Show what each row of a dataset trains on, through the recipes' own data path.

    python scripts/inspect_data.py                                  # the bundled model and data
    python scripts/inspect_data.py --model TinyLlama/TinyLlama-1.1B-Chat-v1.0 --dataset chats.jsonl --rows 3
    python scripts/inspect_data.py --model ./my-model --dataset qa.csv --columns prompt=question,completion=answer
    python scripts/inspect_data.py --dataset chats.jsonl --json > rows.jsonl

The rows are read, checked, detected and tokenised by the same functions a recipe uses
(data_files.read_splits, formats.detect_format, tokens.tokenize_counted with --max-length), so what
is shown is what a run trains on. Each row is printed as its tokens, each token's text with
whitespace made visible (a space is "␣", a newline "↵"), tokens separated by "·"; the trained
tokens (the targets) are coloured on a terminal and inside [[ ]] otherwise. Then each dropped row
with its reason, and the `data:` line a recipe prints.

Preference pairs (`chosen` and `rejected` columns: the DPO recipe's data, preferences.py) are shown
side by side: each pair's chosen and rejected rows as the recipe tokenises them, with --json
{"chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", "dropped"}.

--json prints one JSON object a row instead, in file order (a folder's train split first, then its
evaluation split): {"input_ids": [...], "labels": [...], "dropped": ""} where labels are -100 on the
tokens not trained; a dropped row has empty lists and its reason.

Rows are shown in file order, none held out: a recipe holds out 5% of a single file's rows for
evaluation, tokenised the same way. --model is a hub id or a local folder (a folder holding just a
tokenizer is enough); nothing but the tokenizer is loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "recipes"))

import common.quiet  # noqa: E402,F401  (first: the recipes' filter of library notices)
from common.launching.args import answer_help_with  # noqa: E402
from common.paths import DEFAULT_MODEL  # noqa: E402

BUNDLED_TOKENIZER = REPO_ROOT / "data" / "tokenizer"  # what the bundled model is built with
VISIBLE = {" ": "␣", "\n": "↵\n", "\t": "→", "\r": "␍"}
TRAINED_ON, TRAINED_OFF = "\x1b[1;30;42m", "\x1b[0m"


def flags() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL),
                        help="hub id or local folder whose tokenizer (and chat template) the rows go through "
                             "(default: the bundled tiny Llama)")
    parser.add_argument("--dataset", default=None, help="as the recipes take it (default: the bundled data/)")
    parser.add_argument("--columns", default=None, help="as the recipes take it, e.g. instruction=question,response=answer")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="as the recipes take it (default: the model's own chat template)")
    parser.add_argument("--max-length", type=int, default=512, help="as the recipes take it (default: 512)")
    parser.add_argument("--rows", type=int, default=None,
                        help="show the first K rows (default: 5; with --json every row)")
    parser.add_argument("--json", action="store_true", help="one JSON object a row: input_ids, labels, dropped")
    parser.add_argument("--trust-remote-code", action="store_true", help="as the recipes take it")
    return parser


answer_help_with(flags)  # before the tokenizer's libraries load (seconds)

from common.data import checked_rows, data_files, formats, images, pairs, preferences, tokens  # noqa: E402
from common.launching import preflight  # noqa: E402
from common.model import model_config, modeling, processors  # noqa: E402


def parse_args(argv=None):
    return flags().parse_args(argv)


def tokenizer_of(model: str, trust_remote_code: bool = False, chat_template: str | None = None):
    """The tokenizer a recipe trains with (modeling.load_tokenizer): the bundled model's before its first build."""
    if model_config.is_default_model(model) and not (Path(model) / "tokenizer.json").is_file():
        model = str(BUNDLED_TOKENIZER)
    elif data_files.looks_local(model) and not Path(model).expanduser().exists():
        preflight.refuse(f"--model {model} does not exist; give a model folder (a folder with its tokenizer is "
                         "enough) or a hub id")
    return modeling.load_tokenizer(str(Path(model).expanduser()) if Path(model).expanduser().exists() else model,
                                   trust_remote_code, chat_template)


def length_note(row: dict) -> str:
    """How long a row dropped for its length is: where its first trained token sits (a row's tokens after
    --max-length are cut, so that is what decides)."""
    if not row["dropped"].startswith("too long") or not row.get("needs"):
        return ""
    return f" (its first trained token is token {row['needs']:,}: --max-length {row['needs']} or more keeps it)"


def tokenised_splits(args, tokenizer, log=sys.stdout):
    """[(split name, tokenised rows: input_ids / labels / dropped / needs / cut)], format, data line."""
    if args.dataset and data_files.looks_local(args.dataset) and not Path(args.dataset).expanduser().exists():
        preflight.refuse(f"--dataset {args.dataset} does not exist; give a data file, a folder, or a hub id")
    with contextlib.redirect_stdout(log):  # the `files:` line of a folder
        loaded, spec = data_files.read_splits(args.dataset, args.columns)
    loaded = images.as_read(loaded)
    first = next(iter(loaded.values()))
    paired = pairs.holds_pairs(first)  # preference pairs first: UltraFeedback also has SFT's `messages`
    fmt = pairs.pair_format_of(first, spec) if paired else checked_rows.format_of(first, spec)
    order = sorted(loaded, key=lambda name: (name != "train", name))
    # a vision-language model's rows as its recipe reads them: one placeholder token an image (the processor expands
    # each into the image's tokens as batches load; the `images` of a row are its files)
    model = str(Path(args.model).expanduser()) if Path(args.model).expanduser().exists() else args.model
    processor = None if paired else processors.load(model, tokenizer, args.trust_remote_code)
    if paired:
        splits = [(name, preferences.tokenize_pairs(loaded[name], fmt, tokenizer, args.max_length)) for name in order]
    else:
        splits = [(name, tokens.tokenize_counted(loaded[name], tokenizer, args.max_length,
                                                 images.ImageRows(processor, spec) if processor else None)[0])
                  for name in order]
    unit = "pair" if paired else "row"
    line = f"data ({fmt}): " + "; ".join(f"{name} {tokens.counted(rows, unit)}" for name, rows in splits)
    if len(splits) == 1:  # as a recipe would split them: its counts, not these, are what trains
        held = checked_rows.held_out_count(len(first))
        line += (f" (a recipe given these alone holds out {held} {unit}{'s' if held > 1 else ''} for evaluation and "
                 f"trains on the other {len(first) - held:,}; --eval-dataset names others)")
    return splits, fmt, line + formats.unread_columns(first.column_names, fmt)


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's text as it adds to the decoded row, whitespace made visible (a sentencepiece
    "▁" word start shows as the space it decodes to)."""
    pieces = tokenizer.convert_ids_to_tokens(ids)
    texts = []
    for token_id, piece in zip(ids, pieces):
        text = tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if isinstance(piece, str) and piece.startswith("▁") and not text.startswith(" "):
            text = " " + text  # the decoder drops the first word's space; inside a row it is one
        texts.append("".join(VISIBLE.get(char, char) for char in text) or piece)
    return texts


def marked(tokenizer, row: dict, colour: bool) -> str:
    """The row's tokens, the trained ones coloured or inside [[ ]]."""
    out, inside = [], False
    for i, (text, label) in enumerate(zip(token_texts(tokenizer, row["input_ids"]), row["labels"])):
        trained = label != formats.IGNORE
        if trained != inside:
            out.append((TRAINED_ON if trained else TRAINED_OFF) if colour else ("[[" if trained else "]]"))
            inside = trained
        if i and not out[-1].endswith("\n") and out[-1] not in ("[[", TRAINED_ON):
            out.append("·")
        out.append(text)
    if inside:
        out.append(TRAINED_OFF if colour else "]]")
    return "".join(out)


def sides_of(row: dict, paired: bool) -> list[tuple[str, dict]]:
    """(label, {input_ids, labels}) of each row to print: the row itself, or a pair's chosen and rejected."""
    if not paired:
        return [("", row)]
    return [(f", {side}", {"input_ids": row[f"{side}_input_ids"], "labels": row[f"{side}_labels"]})
            for side in pairs.SIDES]


def main(argv=None) -> int:
    args = parse_args(argv)
    tokenizer = tokenizer_of(args.model, args.trust_remote_code, args.chat_template)
    import datasets

    datasets.disable_progress_bars()
    splits, fmt, line = tokenised_splits(args, tokenizer, log=sys.stderr if args.json else sys.stdout)
    limit = args.rows if args.rows is not None else (None if args.json else 5)
    paired = "chosen_input_ids" in splits[0][1].column_names
    shown_columns = preferences.PAIR_COLUMNS if paired else ["input_ids", "labels"]
    if args.json:
        shown = 0
        for _, rows in splits:
            for row in rows:
                if limit is not None and shown >= limit:
                    break
                print(json.dumps({**{column: row[column] for column in shown_columns}, "dropped": row["dropped"]}))
                shown += 1
        print(line, file=sys.stderr)
        return 0
    colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    shown, dropped = 0, []
    for name, rows in splits:
        for number, row in enumerate(rows, 1):
            if row["dropped"]:
                dropped.append(f"{name} row {number}: {row['dropped']}{length_note(row)}")
                continue
            if limit is not None and shown >= limit:
                continue
            cut = ", cut to --max-length" if row["cut"] else ""
            for side, side_row in sides_of(row, paired):
                trained = sum(label != formats.IGNORE for label in side_row["labels"])
                print(f"--- {name} row {number}{side}: {len(side_row['input_ids'])} tokens, {trained} trained{cut}")
                print(marked(tokenizer, side_row, colour))
            shown += 1
    if dropped:
        print(f"--- dropped ({len(dropped)}):")
        print("\n".join(dropped))
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
