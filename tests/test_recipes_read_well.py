"""The recipes stay what users copy: documented flags match the real ones, the loop is
written out in each, and a copied recipe still runs."""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
from common.args import recipe_flags  # noqa: E402

RECIPES = ["full", "lora", "qlora"]


def help_flags(recipe: str) -> set[str]:
    """The flags of the parser the recipe builds (`parse_args` in each recipe), in-process: running
    `--help` costs a start-up per recipe (the copied-recipe test below runs it once)."""
    source = (REPO / "recipes" / f"{recipe}.py").read_text()
    assert f'cli.recipe_flags("{recipe}", __doc__)' in source
    usage = recipe_flags(recipe, ast.get_docstring(ast.parse(source), clean=False)).format_usage()
    return set(re.findall(r"--[a-z][a-z0-9-]+", usage))


def docstring_flags(recipe: str) -> set[str]:
    source = (REPO / "recipes" / f"{recipe}.py").read_text()
    doc = source.split('"""')[1]
    listed = doc[doc.index("Flags:"):]
    return set(re.findall(r"--[a-z][a-z0-9-]+", listed))


@pytest.mark.parametrize("recipe", RECIPES)
def test_docstring_lists_exactly_the_real_flags(recipe):
    assert docstring_flags(recipe) == help_flags(recipe) - {"--help"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_loop_is_written_out_in_each_recipe(recipe):
    source = (REPO / "recipes" / f"{recipe}.py").read_text()
    for piece in ("accelerator.accumulate(model)", "accelerator.backward(", "clip_grad_norm_(",
                  "optimizer.step()", "scheduler.step()", "optimizer.zero_grad()", "evaluate(",
                  "save_checkpoint(", "resume_from("):
        assert piece in source, f"{recipe}.py lost `{piece}`"
    assert len(source.splitlines()) <= 300


def test_lora_differs_from_full_by_the_lora_lines_only():
    full = (REPO / "recipes" / "full.py").read_text().splitlines()
    lora = (REPO / "recipes" / "lora.py").read_text().splitlines()
    import difflib

    changed = [line for line in difflib.unified_diff(full, lora, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert len(changed) <= 60, "\n".join(changed)


def test_a_copied_recipe_still_runs(tmp_path):
    copy = REPO / "recipes" / "my_copied_lora.py"
    shutil.copy(REPO / "recipes" / "lora.py", copy)
    try:
        done = subprocess.run([sys.executable, str(copy), "--help"], capture_output=True, text=True)
        assert done.returncode == 0 and "--lora-r" in done.stdout, done.stderr
    finally:
        copy.unlink()


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_shows_every_default(recipe):
    parser = recipe_flags(recipe, "recipe\n")
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.option_strings and action.default not in (argparse.SUPPRESS, False, None):
            assert f"(default: {action.default})" in text or "default: " in (action.help or ""), action.option_strings
    assert "(default: 2e-05)" in text if recipe == "full" else "(default: 0.0002)" in text
