"""Images in the rows, for a vision-language model: where a row's images are, what its chat turns look like
with them, and the micro-batches the model takes (its processor's pixels beside the tokens).

A row holds its images in an `images` column (or `image`: one), as paths relative to the data file's folder
or absolute; its chat turns mark each image's place with a `{"type": "image"}` part (TRL's layout) or with
`<image>` in the text (LLaVA's and ShareGPT's). tokens.py renders and tokenises each row with one placeholder
token per image and reads each image's size from its header (nothing decoded: `ImageRows`; a missing or unreadable
file, or more or fewer places than images, is then one line naming the row, on every rank); the processor decodes,
resizes and expands the placeholders a batch at a time as the loader collates (`PadImageRows`), so no image is held
longer than its batch.
"""

from __future__ import annotations

import io
import os
from difflib import SequenceMatcher
from pathlib import Path

import numpy as np

from ..refusal import refuse
from .formats import IGNORE, PLACEHOLDER, lays_out_prompt

IMAGE_COLUMNS = ("images", "image")


def image_column(columns) -> str | None:
    """The column that holds the rows' images, or None."""
    return next((name for name in IMAGE_COLUMNS if name in columns), None)


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
    or a parquet file's Image column) is written once to a file of its own (`stored`)."""
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


def reference_size(reference, folder: Path) -> tuple[int, int] | str:
    """One listed image's (height, width), from its header; or why it cannot be read."""
    if isinstance(reference, dict) and reference.get("bytes") is not None:
        try:
            return header_size(io.BytesIO(reference["bytes"]))
        except OSError as error:
            return f"an image stored in the data cannot be read ({type(error).__name__}: {str(error)[:80]})"
    path = reference.get("path") if isinstance(reference, dict) else reference
    if not isinstance(path, str) or not path:
        return f"an image entry {reference!r} is no path"
    if "://" in path:
        return (f"image {path} is a URL, which the run does not download (there may be no network on the GPUs); "
                "download the images and list their paths")
    try:
        return header_size(image_path(path, folder))
    except FileNotFoundError:
        return f"image {path} does not exist (relative paths start at {folder})"
    except OSError as error:
        return f"image {path} cannot be read ({type(error).__name__}: {str(error)[:80]})"


def header_size(path) -> tuple[int, int]:
    """(height, width) of an image from its file's header, without decoding its pixels."""
    from PIL import Image

    with Image.open(path) as image:
        width, height = image.size
    return height, width


ROW_NUMBER = "row_in_file"  # an image row's place in its file (1 first), for a refusal that names it


def as_read(loaded: dict) -> dict:
    """Every split of a dataset as read (data_files.read_splits), rows with images `undecoded` and `numbered`."""
    return {split: numbered(undecoded(rows)) for split, rows in loaded.items()}


def numbered(rows):
    """`rows` (one split as read, in file order) with each row's place in it as a column, where they hold images: a
    problem found with a row's images while tokenising (tokens.py) names the row in the file."""
    if image_column(rows.column_names) is None or ROW_NUMBER in rows.column_names:
        return rows
    return rows.add_column(ROW_NUMBER, np.arange(1, len(rows) + 1))


class ImageRows:
    """What tokens.py needs of a source's rows with images: where relative paths start, the processor's count of an
    image's tokens, and the source's name for a refusal. `read` is called on each row once, while rank 0 tokenises
    (the result is cached with the tokens): each image's header is read there, never its pixels."""

    def __init__(self, processor, name: str):
        self.processor, self.name, self.folder = processor, name, folder_of(name)
        self.counts = {}  # (height, width) -> the tokens such an image adds, found once a size
        self.layouts, self.offset = {}, None  # see `added`

    def read(self, row: dict, column: str | None, placed: int) -> tuple[list[str], list[int], str]:
        """(the row's image files, the tokens each adds to the row's rendering, why they cannot train: "" when they
        can); `placed`: how many images its turns place (targets.tokenize_rows)."""
        listed = references(row.get(column)) if column else []
        sizes = []
        for reference in listed:
            size = reference_size(reference, self.folder)
            if isinstance(size, str):
                return [], [], size
            sizes.append(size)
        if placed != len(listed):
            return [], [], (f"its turns place {placed} image(s) ({{\"type\": \"image\"}} parts or `{PLACEHOLDER}`) but "
                            f"`{column or 'images'}` lists {len(listed)}; give one place per image")
        return [image_path(reference, self.folder) for reference in listed], self.tokens(sizes), ""

    def fitted(self, row: dict, column: str | None, placed: int, length: int,
               max_length: int) -> tuple[list[str], str, str, int]:
        """(the row's image files, why they cannot train ("" when they can: refused by `refuse_problems`), why the
        row is dropped ("" when kept), the length it needs with its images) of a row `length` tokens long placing
        `placed` images. A row is never cut (that could cut through an image): one longer than `max_length` with
        its images is dropped; a row placing images that lists none (no images column) is dropped too."""
        files, counts, problem = self.read(row, column, placed)
        if problem and column is None:  # no images listed at all: a row of text with a stray place, dropped
            return [], "", "its turns place images but it lists none (an `images` column)", length
        needs = length + sum(counts)  # never cut: all of it
        return files, problem, problem or (f"too long for --max-length {max_length} with its images"
                                           if needs > max_length else ""), needs

    def tokens(self, sizes: list[tuple[int, int]]) -> list[int]:
        """The tokens an image of each of these sizes adds to its row: its expansion (image tokens and whatever the
        family writes around them), less the one placeholder the rendering holds."""
        return [self.added(size) for size in sizes]

    def added(self, size: tuple[int, int]) -> int:
        """The tokens an image of `size` adds, from the processor's own count where it has one (arithmetic: no
        pixels), offset by what its expansion adds around the counted tokens (measured once); else measured on a
        blank image once for each layout its image processor gives that size (SmolVLM's tiles, for one)."""
        if size not in self.counts:
            counted = self.counted(size)
            if counted is not None:
                if self.offset is None:
                    self.offset = self.measured(size) - counted
                self.counts[size] = counted + self.offset
            else:
                patches = getattr(self.processor.image_processor, "get_number_of_image_patches", None)
                layout = patches(*size) if patches else size
                if layout not in self.layouts:
                    self.layouts[layout] = self.measured(size)
                self.counts[size] = self.layouts[layout]
        return self.counts[size]

    def counted(self, size: tuple[int, int]) -> int | None:
        """The processor's count of an image's tokens, or None where it has none."""
        count = getattr(self.processor, "_get_num_multimodal_tokens", None)
        try:
            return count(image_sizes=[size]).num_image_tokens[0] if count else None
        except (NotImplementedError, TypeError, AttributeError, ValueError, KeyError):
            return None

    def measured(self, size: tuple[int, int]) -> int:
        """The tokens a blank image of `size` adds to its placeholder's one, as the processor expands it."""
        from PIL import Image

        tokenizer, image = self.processor.tokenizer, self.processor.image_token
        text = (tokenizer.bos_token or "") + image  # as a rendering starts (mllama adds a BOS)
        if lays_out_prompt(self.processor):  # as its layout starts, for a processor that lays its prompt out itself
            text = image + tokenizer.bos_token + "\n"
        alone = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        blank = Image.new("RGB", (size[1], size[0]))
        return len(processed(self.processor, [text], [[blank]])["input_ids"][0]) - alone

    def refuse_problems(self, tokenised) -> None:
        """Refuse, on every rank (each reads the tokenised rows), the first row in the file whose images cannot
        train: one line naming the row and the file."""
        import pyarrow.compute as pc

        table = tokenised.select_columns(["image_problem", ROW_NUMBER]).with_format("arrow")[:]
        bad = table.filter(pc.not_equal(table["image_problem"], ""))
        if bad.num_rows:
            first = pc.index(bad[ROW_NUMBER], pc.min(bad[ROW_NUMBER])).as_py()
            refuse(f"--dataset {self.name}, row {bad[ROW_NUMBER][first].as_py()}: {bad['image_problem'][first].as_py()}")


def image_rows(parts) -> bool:
    """Whether any source's rows hold images."""
    return any(image_column(part.rows.column_names) for part in parts)


def refuse_image_rows_without(processor, parts, model: str) -> None:
    """Refuse sources holding images for a model that reads text only (no processor), on every rank."""
    if processor is None and image_rows(parts):
        refuse(f"--dataset holds images, but --model {model} reads text only; give an image-text-to-text "
               "model (Qwen2-VL, LLaVA, ...: its config names a vision part), or drop the images column")


class PadImageRows:
    """A micro-batch of image rows (and rows without images) as the model takes it: the processor renders each
    row's text with its images (decoded and resized now, a batch at a time), expanding each image's placeholder
    into the image's tokens as it does at inference, and makes the family's pixel tensors (`pixel_values`, and
    `image_grid_thw`, `image_sizes` or what else the family takes). The labels are the row's as tokens.py found
    them, carried over the expanded tokens (an image's tokens are never targets); padding on the right, masked
    out of attention and loss. A processor that lays its prompt out itself (PaliGemma: `lays_out_prompt`) takes each
    row as its prompt and its reply (`suffix`), and marks the reply in `token_type_ids` (1 from its first token, 0
    on the images, the prompt and the padding), which the model reads as a prefix-LM's mask."""

    def __init__(self, processor):
        self.processor = processor
        processor.tokenizer.padding_side = "right"

    def __call__(self, rows: list[dict]) -> dict:
        import torch

        images = [[load_image(path) for path in row["images"]] for row in rows]  # a list a row: every family takes it
        texts = [row["text"] for row in rows]
        starts = target_starts(self.processor, texts, rows) if lays_out_prompt(self.processor) else None
        batch = processed(self.processor, texts, images if any(images) else None, starts, padding=True,
                          return_tensors="pt")
        batch = {key: value for key, value in batch.items() if torch.is_tensor(value)}
        ids, mask = batch["input_ids"], batch["attention_mask"]
        labels = torch.full_like(ids, IGNORE)
        for i, row in enumerate(rows):
            length = int(mask[i].sum())
            labels[i, :length] = torch.from_numpy(carried_labels(row["input_ids"], row["labels"], ids[i, :length].tolist()))
        batch["labels"] = labels
        if starts is not None and not torch.equal(batch.get("token_type_ids", mask), reply_marks(labels, mask)):
            raise ValueError("the processor's token_type_ids do not mark the reply alone (its tokenizer gives a "
                             "suffix no type 1): the model would read the reply both ways")
        return batch


def reply_marks(labels, mask):
    """1 from each row's first target token through its last token, 0 before it and on the padding: where a
    prefix-LM reads causally (PaliGemma's `token_type_ids`)."""
    import torch

    first = torch.where(labels != IGNORE, torch.arange(labels.shape[1]), labels.shape[1]).min(1, keepdim=True).values
    return ((torch.arange(labels.shape[1]) >= first) & (mask == 1)).long()


# A batch's entries that are no image inputs: the tokens, and what the collators add for the loss
RECIPE_ENTRIES = {"input_ids", "attention_mask", "position_ids", "labels", "target_positions", "loss_weights",
                  "sft_labels", "pair_index", "margin", "desirable", "advantages"}


def model_inputs(batch: dict) -> dict:
    """The batch's inputs for the model's images as the processor made them (`pixel_values`, and `image_grid_thw`,
    `token_type_ids`, `cross_attention_mask` or what else the family takes): everything beside the tokens and the
    recipe's own entries; none for rows of text."""
    return {key: value for key, value in batch.items() if key not in RECIPE_ENTRIES}


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


def prompt_inputs(processor, text: str, files: list[str]):
    """A prompt (its rendering, one placeholder an image) and its image files as the model takes them to generate:
    the processor's tokens, the placeholders expanded, and its pixel tensors (batch of one): PaliGemma's
    `token_type_ids` 0 on the whole prompt, as in training (generate marks each new token 1)."""
    inputs = processed(processor, [text], [[load_image(path) for path in files]] if files else None,
                       return_tensors="pt")
    inputs.pop("labels", None)  # PaliGemma's processor gives some (none a target): not a generation input
    return inputs


def prompt_and_suffix(processor, text: str, start: int) -> tuple[str, str]:
    """(prompt, suffix) as a processor that lays its prompt out itself takes them, of a rendering `text` in its
    layout whose target starts at character `start` (len(text): a prompt alone, suffix ""): the BOS and the "\\n" the
    processor writes around the prompt, and the EOS after the suffix, left to it. ValueError where `text` is not in
    that layout (a chat template of another layout)."""
    tokenizer = processor.tokenizer
    prompt, suffix = text[:start], text[start:]
    images, bos, words = prompt.partition(tokenizer.bos_token)
    if not bos or images.replace(processor.image_token, "") or not words.endswith("\n") or (
            suffix and not suffix.endswith(tokenizer.eos_token)):
        raise ValueError(f"{type(processor).__name__} lays a row out as its images, BOS, the prompt and \"\\n\", "
                         f"then the reply and EOS, but the row's rendering is {text[:80]!r}; leave --chat-template "
                         "out (or give one in that layout)")
    return images + words[:-1], suffix[:-len(tokenizer.eos_token)] if suffix else ""


def target_starts(processor, texts: list[str], rows: list[dict]) -> list[int]:
    """Where each row's target starts in its rendering: the first character of its first trained token."""
    offsets = processor.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return [offsets[i][int(np.flatnonzero(np.asarray(row["labels"]) != IGNORE)[0])][0] for i, row in enumerate(rows)]


def processed(processor, texts: list[str], images, starts: list[int] | None = None, **settings):
    """The processor's inputs of renderings `texts` (one placeholder an image) and their `images`: the tokens, the
    placeholders expanded, and the pixel tensors. A processor that lays its prompt out itself takes each text
    split into its prompt and its suffix, the target from character `starts[i]` (None: prompts alone)."""
    if not lays_out_prompt(processor):
        return processor(text=texts, images=images, add_special_tokens=False, **settings)
    split = [prompt_and_suffix(processor, text, start) for text, start in zip(texts, starts or map(len, texts))]
    return processor(text=[prompt for prompt, _ in split], images=images, add_special_tokens=False,
                     suffix=[suffix for _, suffix in split] if starts is not None else None, **settings)


def load_image(path: str):
    """An image's pixels, as RGB."""
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")

