"""A mistake that needs no model or library is refused before the recipe imports torch, transformers and peft:
the line comes at once, in the words the full checks would use (recipes/common/launching/quick_checks.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
from common.data.data_files import missing_source  # noqa: E402

# Runs a recipe as `python recipes/X.py ...` would, then says which heavy libraries it had imported when it stopped.
RUN = """
import os, runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))  # as `python recipes/X.py` has it
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except BaseException as stop:
    print("stopped:", type(stop).__name__)
print("imported:", sorted(name for name in ("torch", "transformers", "peft", "datasets") if name in sys.modules))
"""


def refused(recipe: str, *flags: str) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", RUN, str(REPO / "recipes" / f"{recipe}.py"), *flags],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    return (errors[-1] if errors else done.stderr[-2000:]), done.stdout


def pairs_and_broken_files(folder):
    rows = [{"prompt": f"Sort: {i} 1", "completion": f"1 {i}"} for i in range(20)]
    (folder / "broken.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:5]) + '{"prompt": "x\n')
    (folder / "pairs").mkdir()
    (folder / "pairs" / "train.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "chosen": r["completion"],
                                                                      "rejected": "no"}) + "\n" for r in rows))
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows))


@pytest.mark.parametrize("recipe, flags, line", [
    ("lora", ["--dataset", "{tmp}/nope.jsonl"], "error: --dataset {tmp}/nope.jsonl does not exist"),
    ("full", ["--learning-rate", "1e-4"], "--learning-rate"),
    ("lora", ["--dataset", "{tmp}/broken.jsonl"], "error: {tmp}/broken.jsonl:6: not valid JSON"),
    ("qlora", ["--dataset", "{tmp}/pairs"], "error: these rows are preference pairs"),
    ("grpo", ["--dataset", "{tmp}/prompts.jsonl"], "error: grpo.py needs a reward for your prompts"),
    ("grpo_full", ["--dataset", "{tmp}/prompts.jsonl", "--reward", "{tmp}/nope.py:f"],
     "error: --reward {tmp}/nope.py:f: {tmp}/nope.py does not exist"),
    ("dpo", ["--lr", "-1"], "error: --lr must be > 0"),
], ids=["missing-file", "typo", "malformed-line", "pairs-to-sft", "no-reward", "missing-reward-file", "range"])
def test_a_mistake_needing_no_library_is_refused_before_torch_loads(recipe, flags, line, tmp_path):
    pairs_and_broken_files(tmp_path)
    got, said = refused(recipe, "--output-dir", str(tmp_path / "out"), *(f.format(tmp=tmp_path) for f in flags))
    assert line.format(tmp=tmp_path) in got, got
    assert "imported: []" in said, said


def test_a_launch_that_can_run_goes_on_to_load_its_libraries(tmp_path):
    """The checks let a good command line through: the recipe goes on to import torch (stopped here by a refusal
    that needs the model: a --max-length beyond its context)."""
    got, said = refused("lora", "--output-dir", str(tmp_path / "out"), "--max-length", "100000", "--max-steps", "1")
    assert "beyond the model's context" in got and "'torch'" in said, (got, said)


def test_a_missing_file_names_the_files_spelled_like_it(tmp_path):
    for name in ("train.jsonl", "eval.jsonl", "notes.md"):
        (tmp_path / name).write_text("")
    assert f"(did you mean {tmp_path / 'train.jsonl'}?)" in missing_source("--dataset", str(tmp_path / "trian.jsonl"))
    assert f"(did you mean {tmp_path / 'train.jsonl'}?)" in missing_source("--dataset", str(tmp_path / "train.json"))
    assert "did you mean" not in missing_source("--dataset", str(tmp_path / "other.jsonl"))
