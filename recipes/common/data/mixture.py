"""Several datasets in one run: `--dataset a.jsonl:0.7 --dataset org/name:2` (or a `dataset:` list in the
run file). A source's weight is the share of its usable training rows a run trains on: 0.7 a random 70%
of them, 2 each of them twice, 1 (no weight) all of them once. The draw depends on --seed and the
source's place in the list only, so every rank and every resume sees the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..refusal import refuse


@dataclass(frozen=True)
class Source:
    spec: str | None  # a file, folder or hub id; None: the bundled data/
    weight: float = 1.0

    def __str__(self) -> str:
        return self.spec or "data/"


def sources_of(given) -> list[Source]:
    """--dataset as the flags hold it (None, one text, or a list of texts) -> its sources."""
    texts = [None] if given is None else [given] if isinstance(given, str) else list(given) or [None]
    sources = [source_of(text) for text in texts]
    named = [str(source) for source in sources]
    twice = sorted({name for name in named if named.count(name) > 1})
    if twice:
        refuse(f"--dataset {twice[0]} is given more than once; give it once, with a weight (e.g. "
               f"--dataset {twice[0]}:2 for each of its rows twice)")
    return sources


def data_specs(args) -> list[tuple[str, str | None]]:
    """(flag, what it names) of each data source a run reads: every --dataset (a weight that is no weight is
    refused here), then --eval-dataset."""
    given = [("--dataset", source.spec) for source in sources_of(args.dataset)]
    return given + [("--eval-dataset", getattr(args, "eval_dataset", None))]


def source_of(text: str | None) -> Source:
    """`SPEC` or `SPEC:WEIGHT`; a path that exists with a colon in its name is a path."""
    if text is None:
        return Source(None)
    spec, colon, weight = text.rpartition(":")
    if not colon or Path(text).expanduser().exists():
        return Source(text)
    try:
        value = float(weight)
    except ValueError:
        return Source(text)  # a colon that is not a weight (`org/name:config` is refused later, as read)
    if not spec.strip():
        refuse(f"--dataset {text} names no dataset before its weight; write --dataset FILE:{weight}")
    if not value > 0 or value == float("inf"):
        refuse(f"--dataset {text}: the weight must be a number above 0 (0.5: half its rows, 2: each row twice); "
               "leave a source out rather than weigh it 0")
    return Source(spec, value)


def draw(rows, source: Source, position: int, seed: int):
    """The rows of `source` a run trains on: each row `int(weight)` times, plus a random share of them
    for the fraction left. `position` is the source's place in the --dataset list."""
    import numpy as np

    if source.weight == 1:
        return rows
    whole, fraction = divmod(source.weight, 1)
    generator = np.random.default_rng([seed, position])
    picked = np.sort(generator.choice(len(rows), round(fraction * len(rows)), replace=False))
    indices = np.concatenate([np.tile(np.arange(len(rows)), int(whole)), picked])
    if not len(indices):
        refuse(f"--dataset {source}:{source.weight:g} draws none of its {len(rows):,} usable rows; give it a larger "
               "weight")
    return rows.select(indices)


def drawn_words(source: Source, drawn: int) -> str:
    """`drawn: 6,993 rows (weight 0.7)` for the source's data line."""
    return f"drawn: {drawn:,} rows (weight {source.weight:g})"


def shares(names: list[str], counts: list[int]) -> str:
    """`a.jsonl 78%, b.jsonl 22%`: each source's share of the training rows."""
    total = sum(counts) or 1
    return ", ".join(f"{name} {count / total:.0%}" for name, count in zip(names, counts))


def joined(parts: list):
    """The sources' drawn rows as one set."""
    import datasets

    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
