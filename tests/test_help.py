"""`--help` of every recipe and script answers before torch, transformers or peft load (they take seconds
on a cold machine): the flags are printed and nothing heavy was imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

PROGRAMS = sorted(path for path in [*(REPO / "recipes").glob("*.py"), *(REPO / "scripts").glob("*.py"),
                                    *(REPO / "scripts" / "measure").glob("*.py")]
                  if 'if __name__ == "__main__"' in path.read_text())  # (recipes/rewards.py is a module to import)
HEAVY = ("torch", "transformers", "peft", "accelerate", "deepspeed", "datasets")
# Runs a program as `python PROGRAM --help` would, then says what it imported.
ASK_FOR_HELP = """
import json, runpy, sys
path = sys.argv[1]
sys.argv = [path, "--help"]
sys.path.insert(0, path.rpartition("/")[0])
code = None
try:
    runpy.run_path(path, run_name="__main__")
except SystemExit as stop:
    code = stop.code
print(json.dumps({"code": code, "heavy": [name for name in %r if name in sys.modules]}))
""" % (HEAVY,)


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda path: str(path.relative_to(REPO)))
def test_help_answers_before_the_heavy_libraries_load(program):
    done = subprocess.run([sys.executable, "-c", ASK_FOR_HELP, str(program)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    *printed, last = done.stdout.strip().splitlines()
    answer = json.loads(last)
    assert answer["code"] in (0, None) and "usage:" in "\n".join(printed), done.stdout[-2000:]
    assert answer["heavy"] == [], f"{program.name} --help imported {answer['heavy']}"
