"""A model's shape from its config.json, with the recipes' own arithmetic: recipes/planner/ (pure Python, no
torch), importable as `planner` because bench/__init__.py puts recipes/ on sys.path."""

from __future__ import annotations

import json
from pathlib import Path

from planner import ModelShape


def shape_of(config_path: Path, layers: int | None = None) -> ModelShape:
    raw = json.loads(Path(config_path).read_text())
    if layers:
        raw["num_hidden_layers"] = int(layers)
    return ModelShape.from_config(raw, name=Path(config_path).stem)
