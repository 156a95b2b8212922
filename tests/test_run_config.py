"""`--config run.yaml`: any flags in a file, the command line overriding it, mistakes named in one line."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402


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
    ("lora-targets: [q_proj, v_proj]\n", "`lora-targets: ['q_proj', 'v_proj']` must be text"),
    ("resume: true\n", "`resume: True` must be text"),
    ("lr: null\n", "`lr` has no value; give one, or delete the line"),
    ("max-steps: 1.9\n", "`max-steps: 1.9` must be a whole number"),
    ("epochs: true\n", "`epochs: True` must be a number"),
    ("max-steps: 2\nmax-steps: 3\n", "cannot be read: `max-steps` is set twice; keep one"),
])
def test_a_mistake_in_the_file_is_one_line(text, message, tmp_path, capsys):
    with pytest.raises(Refusal):
        parsed(tmp_path, text)
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert f"--config {tmp_path / 'run.yaml'}" in line and message in line, line


def test_whole_floats_are_whole_numbers_and_a_null_keeps_a_default_of_none(tmp_path):
    args = parsed(tmp_path, "max-steps: 2.0\ndataset: null\nlora-alpha: 16.5\n")
    assert (args.max_steps, args.dataset, args.lora_alpha) == (2, None, 16.5)
    assert parsed(tmp_path, "gradient-checkpointing: true\n").gradient_checkpointing == 1  # as typed bare
    assert parsed(tmp_path, "gradient-checkpointing: 2\n").gradient_checkpointing == 2


def test_config_given_twice_or_empty_is_one_line(tmp_path):
    (tmp_path / "a.yaml").write_text("lr: 1.0e-3\n")
    (tmp_path / "b.yaml").write_text("lr: 2.0e-3\n")
    with pytest.raises(Refusal, match="--config is given 2 times"):
        parse_args(recipe_flags("lora"), ["--config", str(tmp_path / "a.yaml"), "--config", str(tmp_path / "b.yaml")])
    with pytest.raises(Refusal, match="--config is empty"):
        parse_args(recipe_flags("lora"), ["--config", ""])


def test_a_mistyped_flag_is_one_line(capsys):
    with pytest.raises(Refusal, match="argument --lora-alpha: invalid float value: 'x'; see --help"):
        parse_args(recipe_flags("lora"), ["--lora-alpha", "x"])
    assert "usage:" not in capsys.readouterr().err
