"""`--config run.yaml`: any flags in a file, the command line overriding it, mistakes named in one line."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
from common.args import parse_args, recipe_flags  # noqa: E402
from common.preflight import Refusal  # noqa: E402


def parsed(tmp_path, text: str, *argv: str, recipe: str = "lora"):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return parse_args(recipe_flags(recipe), ["--config", str(path), *argv])


def test_the_file_sets_flags_and_the_command_line_wins(tmp_path):
    args = parsed(tmp_path, "lr: 3.0e-3\nmax-steps: 300\nlora_r: 32\npacking: true\n", "--max-steps", "5")
    assert (args.lr, args.max_steps, args.lora_r, args.packing) == (3e-3, 5, 32, True)
    assert {"lr", "max_steps", "lora_r", "packing"} <= set(args.given_flags)  # a DeepSpeed file cannot override them
    assert "batch_size" not in args.given_flags
    # YAML reads 1e-4 (no dot) as text: converted as if typed
    assert parsed(tmp_path, "lr: 1e-4\n", recipe="full").lr == 1e-4


@pytest.mark.parametrize("text, message", [
    ("max_step: 3\n", "`max_step` is not a flag of this recipe; did you mean `max-steps`?"),
    ("lr: fast\n", "`lr: fast` is not a valid float"),
    ("attention: flash\n", "`attention: flash` is not one of sdpa, eager, flash_attention_2, flex_attention"),
    ("packing: 1\n", "`packing` is a switch; write `packing: true` or `packing: false`"),
    ("- lr\n", "must map flag names to values"),
    ("lr: [1\n", "cannot be read"),
])
def test_a_mistake_in_the_file_is_one_line(text, message, tmp_path, capsys):
    with pytest.raises(Refusal):
        parsed(tmp_path, text)
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert f"--config {tmp_path / 'run.yaml'}" in line and message in line, line
