"""Images in the rows, for a vision-language model: where a row's images are, what its chat turns look like
with them, and the micro-batches the model takes (its processor's pixels beside the tokens).

A row holds its images in an `images` column (or `image`: one), as paths relative to the data file's folder
or absolute; its chat turns mark each image's place with a `{"type": "image"}` part (TRL's layout) or with
`<image>` in the text (LLaVA's and ShareGPT's). The rows are checked on every rank before anything else
(`check_rows`: a missing or unreadable file, more or fewer places than images, is one line naming the row);
tokens.py renders and tokenises each row with one placeholder token per image and reads each image's size
from its header (nothing decoded); the processor decodes, resizes and expands the placeholders a batch at a
time as the loader collates (`PadImageRows`), so no image is held longer than its batch.
"""

from __future__ import annotations

import io
import os
from difflib import SequenceMatcher
from pathlib import Path

import numpy as np

from ..refusal import refuse
from .formats import IGNORE, PLACEHOLDER, conversation, places

IMAGE_COLUMNS = ("images", "image")


def image_column(columns) -> str | None:
    """The column that holds the rows' images, or None."""
    return next((name for name in IMAGE_COLUMNS if name in columns), None)


def places_in_cell(cell) -> int:
    """How many images a row's `messages` cell places (0 for a cell that is no conversation)."""
    turns = conversation(cell)
    return places(turns) if turns else 0


def folder_of(name: str) -> Path:
    """Where a source's relative image paths start: the data file's folder, the data folder itself, or (a hub
    dataset) the current folder."""
    path = Path(os.path.expanduser(name))
    return path.parent if path.is_file() else path if path.is_dir() else Path.cwd()


def references(cell) -> list:
    """A row's images as listed: a list of paths (or of datasets' {"bytes", "path"} cells), one path, or none."""
    if cell is None:
        return []
    if isinstance(cell, (str, dict)):
        return [cell]
    return list(cell)


def image_path(reference, folder: Path) -> str:
    """One image's file, absolute; an image stored inside the data (datasets' {"bytes", "path"}: a hub dataset's
    or a parquet file's Image column) is written once to a file of its own (`stored`). A URL is refused by
    `check_rows`."""
    if isinstance(reference, dict) and reference.get("bytes") is not None:
        return stored(reference["bytes"])
    path = reference.get("path") if isinstance(reference, dict) else reference
    return str((folder / os.path.expanduser(path)).resolve())


def stored(data: bytes) -> str:
    """The file holding an image's bytes, named by their hash under <RECIPES_CACHE or ~/.cache/recipes>/images:
    written whole or not at all (a temporary file renamed), once, whichever process or run needs it first. The
    tokenised rows then list a path, as for images given as files, and the loader reads one batch at a time."""
    import hashlib
    import tempfile

    digest = hashlib.sha256(data).hexdigest()
    root = Path(os.environ.get("RECIPES_CACHE") or Path.home() / ".cache" / "recipes").expanduser() / "images"
    path = root / digest[:2] / digest
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as file:
            file.write(data)
        os.replace(file.name, path)
    return str(path)


def undecoded(rows):
    """`rows` with an image column of datasets' Image feature left undecoded ({"bytes", "path"} cells): reading
    rows must not decode every image."""
    from datasets import Image, List, Sequence

    column = image_column(rows.column_names)
    feature = rows.features.get(column) if column else None
    if isinstance(feature, Image):
        return rows.cast_column(column, Image(decode=False))
    if isinstance(feature, (List, Sequence)) and isinstance(feature.feature, Image):
        return rows.cast_column(column, List(Image(decode=False)))
    return rows


def reference_problem(reference, folder: Path) -> str | None:
    """Why one listed image cannot be read (None when it can): its size is read from the file's header."""
    if isinstance(reference, dict) and reference.get("bytes") is not None:
        try:
            header_size(io.BytesIO(reference["bytes"]))
        except OSError as error:
            return f"an image stored in the data cannot be read ({type(error).__name__}: {str(error)[:80]})"
        return None
    path = reference.get("path") if isinstance(reference, dict) else reference
    if not isinstance(path, str) or not path:
        return f"an image entry {reference!r} is no path"
    if "://" in path:
        return (f"image {path} is a URL, which the run does not download (there may be no network on the GPUs); "
                "download the images and list their paths")
    try:
        header_size(image_path(path, folder))
    except FileNotFoundError:
        return f"image {path} does not exist (relative paths start at {folder})"
    except OSError as error:
        return f"image {path} cannot be read ({type(error).__name__}: {str(error)[:80]})"
    return None


def header_size(path) -> tuple[int, int]:
    """(height, width) of an image from its file's header, without decoding its pixels."""
    from PIL import Image

    with Image.open(path) as image:
        width, height = image.size
    return height, width


def check_rows(rows, name: str) -> None:
    """Refuse, on every rank, the first row of `rows` (one split of --dataset `name`, in file order) whose images
    cannot be read or do not match the places its turns give them: one line naming the row and the file."""
    column = image_column(rows.column_names)
    if column is None:
        return
    folder = folder_of(name)
    has_messages = "messages" in rows.column_names
    for number, row in enumerate(rows.select_columns([column] + (["messages"] if has_messages else [])), 1):
        listed = references(row[column])
        for reference in listed:
            problem = reference_problem(reference, folder)
            if problem:
                refuse(f"--dataset {name}, row {number}: {problem}")
        placed = places_in_cell(row["messages"]) if has_messages else len(listed)
        if placed != len(listed):
            refuse(f"--dataset {name}, row {number}: its turns place {placed} image(s) ({{\"type\": \"image\"}} parts or "
                   f"`{PLACEHOLDER}`) but `{column}` lists {len(listed)}; give one place per image")


def image_rows(parts) -> bool:
    """Whether any source's rows hold images."""
    return any(image_column(part.rows.column_names) for part in parts)


class ImageSizes:
    """How many tokens a processor expands each image of a row into, from the images' sizes (read from their
    headers): what a row holds once collated, for the --max-length check before training."""

    def __init__(self, processor):
        self.processor = processor

    def tokens(self, sizes: list[tuple[int, int]]) -> list[int] | None:
        """Tokens each image takes, or None when the processor cannot tell before seeing the pixels."""
        if not sizes:
            return []
        count = getattr(self.processor, "_get_num_multimodal_tokens", None)
        try:
            return list(count(image_sizes=sizes).num_image_tokens) if count else None
        except (NotImplementedError, TypeError, AttributeError, ValueError):
            return None


class PadImageRows:
    """A micro-batch of image rows (and rows without images) as the model takes it: the processor renders each
    row's text with its images (decoded and resized now, a batch at a time), expanding each image's placeholder
    into the image's tokens as it does at inference, and makes the family's pixel tensors (`pixel_values`, and
    `image_grid_thw`, `image_sizes` or what else the family takes). The labels are the row's as tokens.py found
    them, carried over the expanded tokens (an image's tokens are never targets); padding on the right, masked
    out of attention and loss."""

    def __init__(self, processor):
        self.processor = processor
        processor.tokenizer.padding_side = "right"

    def __call__(self, rows: list[dict]) -> dict:
        import torch

        images = [load_image(path) for row in rows for path in row["images"]]
        batch = self.processor(text=[row["text"] for row in rows], images=images or None, add_special_tokens=False,
                               padding=True, return_tensors="pt")
        batch = {key: value for key, value in batch.items() if torch.is_tensor(value)}
        ids, mask = batch["input_ids"], batch["attention_mask"]
        labels = torch.full_like(ids, IGNORE)
        for i, row in enumerate(rows):
            length = int(mask[i].sum())
            labels[i, :length] = torch.from_numpy(carried_labels(row["input_ids"], row["labels"], ids[i, :length].tolist()))
        batch["labels"] = labels
        return batch


def carried_labels(ids, labels, expanded: list[int]) -> np.ndarray:
    """`labels` (laid out like `ids`, a row as tokens.py tokenised it) laid out like `expanded` (the same row as
    the processor tokenised it, its images' placeholders expanded): each target lands on its own token, every
    other token is IGNORE. A target that the expansion changed is an error: it would train what the model does
    not see."""
    ids, labels = list(ids), np.asarray(labels)
    carried = np.full(len(expanded), IGNORE, dtype=np.int64)
    for a, b, size in SequenceMatcher(None, ids, expanded, autojunk=False).get_matching_blocks():
        carried[b:b + size] = labels[a:a + size]
    if (carried != IGNORE).sum() != (labels != IGNORE).sum():
        raise ValueError("the processor's tokens of a row differ from its training tokens around a target; "
                         "its chat template or placeholders do not match the processor's")
    return carried


def load_image(path: str):
    """An image's pixels, as RGB."""
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")

