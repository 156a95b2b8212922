"""The repository's folders the benchmark reads; recipes/ goes on sys.path for the recipes' own modules."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "recipes"))  # planner (model shapes) and common.data.formats (tokenisation)

TOKENIZER_DIR = REPO / "data" / "tokenizer"
TINY_MODEL = REPO / "models" / "tiny-llama"
TINY_CONFIG = REPO / "data" / "tiny-llama-config.json"
CONFIGS = REPO / "accelerate_configs"
