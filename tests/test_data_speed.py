"""scripts/measure/data_speed.py at a tiny size: the limit and the recipes' one-process sides, cold and cached,
for both tokenizers and both formats. What it checks holds on any machine (no timing): every side has
its row, the recipes keep every generated row, a rerun reads the cache it left, and the large
tokenizer is one of a real model's size. A long test (about 100 s, most of it building the 32k
tokenizer and running both sides twice): results/2026-11-26_cpu_long-data-speed holds its run; the
figures at 200,000 rows are in results/2026-11-26_cpu_data-speed-200k."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import long_test

REPO = Path(__file__).resolve().parents[1]
ROWS = 300
SIDES = ("limit", "recipes-1-cold", "recipes-1-cached")


@long_test
def test_every_side_is_measured_and_a_rerun_reuses_the_recipes_cache(tmp_path):
    out = tmp_path / "results"
    done = subprocess.run([sys.executable, "scripts/measure/data_speed.py", "--rows", str(ROWS), "--sides", "limit,recipes-1",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    record = json.loads((out / "results.json").read_text())
    rows = {(row["tokenizer"], row["data"], row["side"]): row for row in record["results"]}
    assert set(rows) == {(tokenizer, data, side) for tokenizer in ("bundled", "sentencepiece-32k")
                         for data in ("chat", "instruction") for side in SIDES}

    for (tokenizer, data, side), row in rows.items():
        assert row["rows"] == ROWS, (tokenizer, data, side)
        # every generated row can train: the recipes keep as many as the limit renders
        assert row["kept"] == rows[tokenizer, data, "limit"]["kept"] == ROWS, (tokenizer, data, side, row["kept"])
        assert row["seconds"] > 0 and all(mib > 0 for mib in row["peak_mib_per_rank"].values()), row
        if side == "recipes-1-cold":
            assert all(written > 0 for written in row["new_cache_files"]), row  # it tokenised
        if side == "recipes-1-cached":
            assert row["new_cache_files"] == [0] * record["repeats"], row  # it read what the cold run wrote

    vocabularies = {name: info["vocab_size"] for name, info in record["tokenizers"].items()}
    assert vocabularies["sentencepiece-32k"] >= 30_000 > vocabularies["bundled"]
    # a real vocabulary writes the same text in far fewer tokens than the bundled character-level one
    for data in ("chat", "instruction"):
        assert rows["sentencepiece-32k", data, "limit"]["tokens"] * 2 < rows["bundled", data, "limit"]["tokens"]

    table = (out / "results.md").read_text()
    assert "python scripts/measure/data_speed.py --rows 300 --sides limit,recipes-1" in table
    assert table.count("recipes, 1 process, cached") == 4


def test_help_names_every_side():
    done = subprocess.run([sys.executable, "scripts/measure/data_speed.py", "--help"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0
    for side in ("limit", "recipes-1", "recipes-2", "packed", "trl", "--launch"):
        assert side in done.stdout
