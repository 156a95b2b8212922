"""The recipes stay what users copy: documented flags match the real ones, the loop is
written out in each, and a copied recipe still runs."""

from __future__ import annotations

import argparse
import ast
import re
import sys

import pytest

from conftest import REPO, launch
from strategies import matrix_args

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
                  "save_checkpoint(", "resume_from(", "token_loss = torch.nn.functional.cross_entropy(",
                  "loss_sum / step_tokens"):
        assert piece in source, f"{recipe}.py lost `{piece}`"
    assert len(source.splitlines()) <= 300


def test_lora_differs_from_full_by_the_lora_lines_only():
    full = (REPO / "recipes" / "full.py").read_text().splitlines()
    lora = (REPO / "recipes" / "lora.py").read_text().splitlines()
    import difflib

    changed = [line for line in difflib.unified_diff(full, lora, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert len(changed) <= 60, "\n".join(changed)


def test_a_copied_recipe_edited_in_its_loss_still_runs_and_trains_on_the_edit(trained, tmp_path):
    """Copy lora.py, weight every target token by 2 in the copy alone, and launch it: the first step's
    loss (before any update) is twice that of the untouched recipe on the same batch."""
    source = (REPO / "recipes" / "lora.py").read_text()
    edit = ("loss_sum = token_loss.sum()", "loss_sum = (token_loss * 2.0).sum()  # every target token counts twice")
    assert source.count(edit[0]) == 1
    copy = REPO / "recipes" / "my_weighted_lora.py"
    copy.write_text(source.replace(*edit))
    try:
        run = launch("my_weighted_lora", tmp_path / "out", *matrix_args("lora", "model_parallel"), "--max-steps", "1",
                     config="model_parallel", processes=1)
    finally:
        copy.unlink()
    assert run.returncode == 0, run.output[-3000:]
    reference = trained("lora", "model_parallel")
    assert run.losses() == pytest.approx([2 * reference.losses()[0]], rel=1e-6)


@pytest.mark.parametrize("recipe", RECIPES)
def test_help_shows_every_default(recipe):
    parser = recipe_flags(recipe, "recipe\n")
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.option_strings and action.default not in (argparse.SUPPRESS, False, None):
            assert f"(default: {action.default})" in text or "default: " in (action.help or ""), action.option_strings
    assert "(default: 2e-05)" in text if recipe == "full" else "(default: 0.0002)" in text
