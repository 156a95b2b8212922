"""Where the repository and the bundled tiny model live. Imports nothing heavy: the flags' defaults read it
before torch loads, so that `--help` answers at once."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "models" / "tiny-llama"


def is_default_model(name: str) -> bool:
    return Path(name).resolve() == DEFAULT_MODEL.resolve()
