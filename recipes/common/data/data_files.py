"""Users' data as they have it -> its splits as `datasets.Dataset`s, each file checked as it is read.

A hub id, a folder (split by file names, or written by save_to_disk) or one file (.jsonl, .json,
.parquet, .txt, .csv, .tsv, also gzipped). Every rank reads and checks the files itself: a file that
cannot be read is one line on every rank naming file:line or the layout and the fix, never a
traceback from deep inside pyarrow. checked_rows.py finds the rows' format and sets the evaluation
rows apart.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import planner

from ..refusal import refuse
from ..strict_reading import DuplicateKey, mapping_without_repeats
from .formats import TEXT_COLUMNS

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_DATASET = REPO_ROOT / "data"
DEFAULT_PAIRS = DEFAULT_DATASET / "preferences"  # what the preference recipes train on by default

FILE_LOADERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv", ".tsv": "csv"}
DELIMITERS = {".csv": ",", ".tsv": "\t"}
# A file's split, from the start of its name (train.jsonl, validation-00000-of-00001.parquet, dev_set.csv).
SPLIT_NAMES = {"train": ("train", "training"), "eval": ("eval", "evaluation"),
               "validation": ("validation", "valid", "val", "dev"), "test": ("test",)}
EVAL_SPLIT_NAMES = ("eval", "validation", "test")


LONG_WAIT_ROWS = 50_000  # rows whose tokenising is said in a line before it starts (seconds, or minutes)


def say_long_wait(count: int, what: str) -> None:
    """One line before tokenising `count` rows (or prompts) where that takes long: datasets' own bar is off
    (quiet.py). The first process only."""
    if count >= LONG_WAIT_ROWS and int(os.environ.get("RANK", "0")) == 0:
        print(f"tokenising {count:,} {what} (a rerun reads datasets' cache)", flush=True)


def looks_local(name: str) -> bool:
    """A path rather than a hub id (`org/name`; a name may hold dots: Qwen/Qwen2.5-7B, meta-llama/Llama-3.1-8B)."""
    org, _, repo = name.partition("/")
    return (name.startswith((".", "/", "~")) or name.count("/") != 1 or not (org and repo)
            or suffix(Path(name)) in FILE_LOADERS)  # data/train.jsonl


def missing_source(flag: str, spec: str) -> str | None:
    """The refusal of a --dataset / --eval-dataset that names nothing here and is no hub id: plan.py's
    placeholder left in, or a path that does not exist (None: a file or folder here, or a hub id). Known
    without the network, so it comes before anything asks the hub."""
    if not spec or Path(spec).expanduser().exists() or not looks_local(spec):
        return None
    if spec == planner.DATASET_PLACEHOLDER:
        return (f"{flag} {spec} is the word plan.py's Launch line asks you to replace: give your data instead, "
                "a .jsonl/.json/.parquet/.txt/.csv/.tsv file, a folder of them, or a hub id (org/name)")
    near = near_names(Path(spec).expanduser())
    return (f"{flag} {spec} does not exist" + (f" (did you mean {' or '.join(near)}?)" if near else "")
            + "; give a .jsonl/.json/.parquet/.txt/.csv/.tsv file, a folder of them, or a hub id")


def near_names(path: Path) -> list[str]:
    """Up to 3 names beside a missing `path` that are spelled like it (a typo, another extension), as paths
    written the way `path` was; [] where its folder does not exist either."""
    import difflib

    folder = path.parent
    if not folder.is_dir():
        return []
    names = sorted(entry.name for entry in folder.iterdir() if not entry.name.startswith("."))
    near = difflib.get_close_matches(path.name, names, n=3, cutoff=0.75)
    near += [name for name in names if name not in near and Path(name).stem == path.stem][:3 - len(near)]
    return [str(path.with_name(name)) for name in near]


def hub_not_read(spec: str, error: BaseException) -> str | None:
    """The refusal of a hub dataset that could not load because this process may not ask the hub (offline
    mode: HF_HUB_OFFLINE, or set at start-up when the hub did not answer) and it is not cached here; None for
    any other failure."""
    from huggingface_hub import constants, is_offline_mode

    if not (is_offline_mode() and isinstance(error, ConnectionError)):  # datasets' "Couldn't reach ... on the Hub"
        return None
    return (f"--dataset {spec} is not in this machine's cache and the hub ({constants.ENDPOINT}) is not read here "
            "(offline, or it did not answer); load it once where the hub can be reached (the cache is "
            "HF_HOME), or give a local file or folder")


def suffix(path: Path) -> str:
    """The data file's kind: `.jsonl` also for `rows.jsonl.gz` (datasets reads gzip files itself)."""
    name = path.name.lower()
    return Path(name[:-3]).suffix if name.endswith(".gz") else Path(name).suffix


def file_bytes(path: Path) -> bytes:
    import gzip

    return gzip.decompress(path.read_bytes()) if path.name.lower().endswith(".gz") else path.read_bytes()


def split_of(file: Path) -> str | None:
    """train / eval / validation / test from the file's name, or None (data of no named split)."""
    import re

    stem = file.name.lower()
    return next((split for split, names in SPLIT_NAMES.items()
                 if any(re.match(rf"{name}(?![a-z])", stem) for name in names)), None)


def loader_options(file: Path) -> dict:
    """What datasets' loader needs to read the file's cells as written: a CSV / TSV cell is text
    (pandas would turn 007 into 7, 1.50 into 1.5 and NA into a missing value, and guesses each
    10,000-row chunk's types apart), and a text file's byte-order mark is not text."""
    if suffix(file) == ".txt":
        return {"encoding": "utf-8-sig"}
    if suffix(file) not in DELIMITERS:
        return {}
    import csv
    import gzip

    from datasets import Features, Value

    opener = gzip.open if file.name.lower().endswith(".gz") else open
    with opener(file, "rt", newline="", encoding="utf-8-sig") as handle:
        header = next(csv.reader(handle, delimiter=DELIMITERS[suffix(file)]), [])
    return {"delimiter": DELIMITERS[suffix(file)], "keep_default_na": False,
            "features": Features({name: Value("string") for name in header})}


def root_cause(error: BaseException) -> str:
    """The first line of the innermost exception: datasets wraps the reader's own message (the line
    and the problem) in "An error occurred while generating the dataset"."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def column_renames(columns: str | None) -> dict:
    """--columns "instruction=question,response=answer" -> {"question": "instruction", "answer": "response"}."""
    pairs = [(new.strip(), old.strip()) for new, _, old in (pair.partition("=") for pair in (columns or "").split(","))
             if old.strip()]
    targets = [new for new, _ in pairs]
    twice = sorted({new for new in targets if targets.count(new) > 1})
    if twice:
        refuse(f"--columns maps more than one column onto {', '.join(twice)}; give each target column once")
    return {old: new for new, old in pairs}


def check_files(files: list[Path], columns: str | None) -> dict:
    """JSON and text files, read line by line: the first line that is not UTF-8, not JSON, or holds
    something other than text where text belongs is named as file:line (datasets would raise a long
    traceback from deep inside pyarrow). Returns each JSON file's columns (those of its first row).

    A file checked before, unchanged since (its size, modification time and ends), is not read again:
    a rerun or a resume of a large dataset starts at once."""
    renames = column_renames(columns)
    columns_of = {}
    for path in files:
        if suffix(path) not in (".jsonl", ".json", ".txt", ".csv", ".tsv"):
            continue
        mark = check_mark(path, renames)
        if mark is not None and mark.exists():
            found = json.loads(mark.read_text())
        else:
            found = check_file(path, renames)
            if mark is not None:
                write_atomically(mark, json.dumps(found))
        if found is not None:
            columns_of[path] = found
    return columns_of


def check_mark(path: Path, renames: dict) -> Path | None:
    """Where the check of this file, as it is now and with these renames, is remembered (beside datasets'
    cache); None where that cache cannot be written."""
    import hashlib

    from huggingface_hub import constants  # (not datasets.config: importing datasets takes seconds, and the
    # recipes check files before loading any library)

    try:
        stat = path.stat()
        with path.open("rb") as handle:  # its ends too: a file rewritten within the clock's tick keeps its time
            head = handle.read(1 << 16)
            handle.seek(max(0, stat.st_size - (1 << 16)))
            ends = head + handle.read()
        key = json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns, hashlib.sha256(ends).hexdigest(),
                          renames, hashlib.sha256(Path(__file__).read_bytes()).hexdigest()])
        # datasets' cache folder by datasets' own rule: HF_DATASETS_CACHE, else HF_HOME/datasets
        cache = os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets"
        folder = Path(cache) / "recipes-checked-files"
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return folder / hashlib.sha256(key.encode()).hexdigest()[:32]


def write_atomically(path: Path, text: str) -> None:
    """Whole or absent, whichever rank writes it first."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    except OSError:
        partial.unlink(missing_ok=True)


def check_file(path: Path, renames: dict) -> list | None:
    """One file's check (see check_files): its columns for a JSON file, else None."""
    raw = file_bytes(path)
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark at the start is fine (datasets skips it too)
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        refuse(f"{path}:{line}: not UTF-8 (byte 0x{raw[error.start]:02x}); save the file as UTF-8")
    if not text.strip():
        refuse(f"{path} is empty; put rows in it or delete it")
    if suffix(path) in DELIMITERS:
        check_header(path, text)
    if suffix(path) not in (".jsonl", ".json"):
        return None
    # One JSON document (a list of rows, whatever the file's name), or JSON Lines.
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        if suffix(path) == ".json" and text.lstrip().startswith("["):
            refuse(f"{path}:{error.lineno}: not valid JSON ({error.msg}, column {error.colno}); fix the file")
    else:
        one_row = suffix(path) == ".jsonl" and "\n" not in text.strip()  # JSON Lines of one row: a row
        if isinstance(document, dict) and not one_row and any(isinstance(value, list) for value in document.values()):
            refuse(f"{path} is one JSON object of lists, not rows; save the rows as a JSON array "
                   "([{\"column\": value, ...}, ...]) or as JSON Lines (one object per line)")
        if isinstance(document, list):
            for number, row in enumerate(document, 1):
                check_row(row, f"{path}: row {number}", "fix that row", renames)
            return sorted(document[0]) if document else []
    first = None
    # Rows end at "\n" only: str.splitlines() would also cut a row at U+2028 inside a string.
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            if number == 1 and line.strip() in ("{", "["):
                refuse(f"{path} is pretty-printed JSON (one row over several lines); write one row per "
                       "line (JSON Lines), or save a JSON array of rows as a .json file")
            refuse(f"{path}:{number}: not valid JSON ({error.msg}, column {error.colno}); fix or delete that line")
        check_row(row, f"{path}:{number}", "fix or delete that line", renames)
        if first is None:
            first = sorted(row)
    return first


def check_header(path: Path, text: str) -> None:
    import io
    from itertools import islice

    lines = list(islice((line for line in io.StringIO(text) if line.strip()), 2))  # the header and one row
    if len(lines) < 2:
        refuse(f"{path} has a header line but no rows; put rows under it or delete it")
    delimiter = DELIMITERS[suffix(path)]
    if delimiter not in lines[0]:
        other = next((mark for mark in (";", "\t", ",", "|") if mark != delimiter and mark in lines[0]), None)
        if other:
            shown = "a tab" if other == "\t" else f"`{other}`"
            refuse(f"{path} separates its columns with {shown}; a {suffix(path)} file is read with "
                   f"{'commas' if delimiter == ',' else 'tabs'}: rewrite it so (tabs: name it .tsv)")


def duplicate_key(files: list[Path]) -> str | None:
    """file:line of the first JSON row that names a column twice (json keeps the last; datasets fails)."""
    for path in files:
        if suffix(path) not in (".jsonl", ".json"):
            continue
        for number, line in enumerate(file_bytes(path).decode("utf-8-sig").split("\n"), 1):
            try:
                json.loads(line, object_pairs_hook=mapping_without_repeats)
            except DuplicateKey as twice:
                return f"{path}:{number}: `{twice}` appears twice in one row; keep one"
            except ValueError:
                continue
    return None


def check_row(row, where: str, fix: str, renames: dict) -> None:
    """A row is a JSON object whose text columns hold text (or null)."""
    if not isinstance(row, dict):
        refuse(f"{where}: a row must be a JSON object ({{\"column\": value, ...}}), got {type(row).__name__}; {fix}")
    for column, value in row.items():
        name = renames.get(column, column)
        if name in ("prompt", "completion") and isinstance(value, list) and all(isinstance(turn, dict) for turn in value):
            continue  # TRL's conversational prompt-completion: messages, read as a conversation
        if name in TEXT_COLUMNS and not isinstance(value, (str, type(None))):
            refuse(f"{where}: `{column}` must be text (or null), got {json.dumps(value)[:40]}; {fix}")


def read_splits(spec: str | None, columns: str | None = None):
    """(the dataset's splits as read and checked, rows in file order and none held out yet; `spec` as
    read, the bundled data/ when None): what load_splits splits, and what scripts/inspect_data.py shows."""
    import datasets

    spec = os.path.expanduser(str(spec or DEFAULT_DATASET))
    path = Path(spec)
    missing = missing_source("--dataset", spec)
    if missing:  # datasets would ask the hub for it first (and retry)
        refuse(missing)
    if path.is_file() and path.stat().st_size == 0:
        refuse(f"--dataset {spec} is an empty file; point it at a file or folder with training data")
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its log line would repeat the refusal's cause
    try:
        if path.is_file():
            check_files([path], columns)
            loaded = datasets.load_dataset(FILE_LOADERS.get(suffix(path), "json"), data_files={"train": str(path)},
                                           **loader_options(path))
        elif saved_by_datasets(path):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.Dataset):
                loaded = datasets.DatasetDict({"train": loaded})
        elif path.is_dir():
            loaded = load_folder(path, columns)
        else:
            loaded = datasets.load_dataset(spec)
    except Exception as error:  # datasets / pyarrow / the hub on data they cannot read: one line, not a traceback
        files = sorted(path.iterdir()) if path.is_dir() else [path] if path.is_file() else []
        offline = None if path.exists() else hub_not_read(spec, error)  # datasets' own words name no fix
        refuse(duplicate_key(files) or offline or f"--dataset {spec} cannot be read: {root_cause(error)}")
    finally:
        datasets.logging.set_verbosity(verbosity)
    train = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    if len(train) == 0:
        refuse(f"--dataset {spec} has no rows; point it at a file or folder with training data")
    if columns:
        mapping = column_renames(columns)
        missing = sorted(set(mapping) - set(train.column_names))
        if missing:
            refuse(f"--columns names {missing}, which --dataset does not have (it has {sorted(train.column_names)})")
        clash = sorted(new for new in mapping.values() if new in train.column_names and new not in mapping)
        if clash:
            refuse(f"--columns maps a column onto {', '.join(clash)}, which --dataset already has; map that one "
                   f"too (e.g. --columns {clash[0]}_old={clash[0]},...) or pick the existing column instead")
        loaded = loaded.rename_columns(mapping)
    return with_text_columns(conversations_of_prompt_completion(loaded)), spec


def conversations_of_prompt_completion(loaded):
    """TRL's conversational prompt-completion rows (`prompt` and `completion` each a list of messages) as
    `messages` rows: the prompt's turns are context (an assistant turn in it is not trained), the
    completion's replies are the targets."""
    train = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    if not {"prompt", "completion"} <= set(train.column_names) or "messages" in train.column_names:
        return loaded
    first = next((row for row in train.select_columns(["prompt", "completion"]) if row["prompt"] is not None), None)
    if not (first and isinstance(first["prompt"], list) and isinstance(first["completion"], list)):
        return loaded

    def as_messages(batch: dict) -> dict:
        messages = []
        for prompt, completion in zip(batch["prompt"], batch["completion"]):
            context = [dict(turn, weight=0) if isinstance(turn, dict) else turn for turn in prompt or []]
            messages.append(context + [dict(turn, weight=1) if isinstance(turn, dict) else turn for turn in completion or []])
        return {"messages": messages}

    return loaded.map(as_messages, batched=True, remove_columns=["prompt", "completion"],
                      desc="prompt and completion -> messages")


def saved_by_datasets(path: Path) -> bool:
    """A folder written by datasets' save_to_disk (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or
                              ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()))


def with_text_columns(loaded):
    """ShareGPT's `conversations` column is `messages`; a column of numbers that a format reads as text
    (a CSV or parquet answer column of 0, 1, 2) becomes text, as it would be written in a prompt."""
    from datasets import Value

    for split, part in loaded.items():
        if "conversations" in part.column_names and "messages" not in part.column_names:
            part = part.rename_column("conversations", "messages")
        for name, feature in part.features.items():
            if name in TEXT_COLUMNS and isinstance(feature, Value) and feature.dtype.startswith(("int", "uint", "float")):
                part = part.cast_column(name, Value("string"))
        loaded[split] = part
    return loaded


def folder_splits(folder: Path, columns: str | None = None) -> tuple[Path, dict[str, list[Path]], dict[Path, list]]:
    """(the folder read, {split: its files}, each JSON file's columns) of a --dataset folder: files named train* /
    eval* / validation* (val*, dev*) / test* (other files are notes or configs), or, when nothing is named so, its
    data files as the training split. A folder whose data files are all in one subfolder (a hub dataset as
    downloaded: README.md beside data/) is read from that subfolder. Reads no library: the recipes check a
    folder with it before torch loads."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and suffix(p) in FILE_LOADERS)
    if not files:
        inner = sorted(p.name for p in folder.iterdir() if p.is_dir() and any(
            suffix(f) in FILE_LOADERS for f in p.iterdir() if f.is_file()))
        if len(inner) == 1:
            return folder_splits(folder / inner[0], columns)
        refuse(f"--dataset {folder} holds no .jsonl/.json/.parquet/.txt/.csv/.tsv file"
               + (f"; its folders {', '.join(f'{name}/' for name in inner)} do: point --dataset at the one to "
                  f"train on, e.g. {folder / inner[0]}" if inner else ""))
    named = [f for f in files if split_of(f)]
    by_split = {}
    for file in named or files:
        by_split.setdefault(split_of(file) or "train", []).append(file)
    if "train" not in by_split:
        refuse(f"--dataset {folder} has {', '.join(sorted(by_split))} files but no train* file; name the training "
               "file train.jsonl (or similar), or point --dataset at it")
    kinds = {FILE_LOADERS[suffix(f)] + DELIMITERS.get(suffix(f), "") for f in named or files}
    if len(kinds) > 1:
        listed = ", ".join(f.name for f in named or files)
        refuse(f"--dataset {folder} mixes file formats ({listed}); keep one format, or point --dataset at one file")
    columns_of = check_files(named or files, columns)
    for split, group in by_split.items():
        differ = [f for f in group if columns_of.get(f, columns_of.get(group[0])) != columns_of.get(group[0])]
        if differ:
            refuse(f"--dataset {folder}: {group[0].name} and {differ[0].name} are both read as the {split} split "
                   f"but have different columns; move the file that is not {split} data out of the folder, or "
                   "point --dataset at one file")
    return folder, by_split, columns_of


def load_folder(given: Path, columns: str | None = None):
    """A --dataset folder's splits (folder_splits), loaded one split at a time."""
    import datasets

    folder, by_split, _ = folder_splits(given, columns)
    if int(os.environ.get("RANK", "0")) == 0:  # which file is which split, and what was left out
        used = "; ".join(f"{split}: {', '.join(str(f.relative_to(given)) for f in group)}"
                         for split, group in sorted(by_split.items(), key=lambda item: item[0] != "train"))
        read = {f for group in by_split.values() for f in group}
        left = [f.name for f in folder.iterdir() if f.is_file() and f not in read]
        print(f"files: {used}" + (f"; not read: {', '.join(sorted(left))}" if left else ""), flush=True)
    # one split at a time: datasets reads every split with the first split's columns otherwise
    loaded = datasets.DatasetDict({
        split: datasets.load_dataset(FILE_LOADERS[suffix(group[0])], data_files={split: [str(f) for f in group]},
                                     **loader_options(group[0]))[split]
        for split, group in by_split.items()})
    columns_of = {split: sorted(part.column_names) for split, part in loaded.items()}
    if len({tuple(names) for names in columns_of.values()}) > 1:
        refuse(f"--dataset {folder}: the splits have different columns ({'; '.join(f'{s}: {c}' for s, c in columns_of.items())}); "
               "give every file the same columns")
    return loaded
