"""The supported range of library versions: the lowest ones (recipes/common/launching/versions.py) agree with
requirements-lowest.txt, the pinned set is inside the range, and an older library is refused in one line
before anything loads. (scripts/measure/test_lowest_versions.sh runs the launches on the lowest versions.)"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from unittest import mock

import pytest
from packaging.version import Version

from conftest import REPO

sys.path.insert(0, str(REPO / "recipes"))
from common.launching import preflight, settle, versions  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402


def pins(path) -> dict:
    found = {}
    for line in (REPO / path).read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, _, pinned = line.partition("==")
            found[name.strip().lower().replace("-", "_")] = pinned.strip()
    return found


def test_the_lowest_file_pins_the_lowest_versions_and_the_pinned_set_is_inside_the_range():
    lowest, pinned = pins("requirements-lowest.txt"), pins("requirements.txt")
    for name, version in versions.LOWEST.items():
        assert Version(pinned[name]) >= Version(version), name
        if name != "torch":  # the lowest file keeps the CPU torch this machine has (the script can install 2.11)
            assert Version(lowest[name]).release[:2] == Version(version).release[:2], name
    assert set(lowest) == set(pinned)  # the same packages, only some of them older


def test_what_is_installed_is_supported():
    assert versions.too_old() == []


def test_an_older_library_is_named_with_the_fix_before_anything_loads(tmp_path, monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "5.10.0" if name == "transformers" else real(name))
    assert versions.too_old() == ["transformers 5.10.0 (needs >= 5.17)"]
    args = parse_args(recipe_flags("lora", "LoRA."), ["--output-dir", str(tmp_path / "out")])
    with mock.patch.dict(os.environ), pytest.raises(Refusal) as refusal:
        settle.settle_launch(args, "lora")
    assert str(refusal.value) == ("too old for these recipes: transformers 5.10.0 (needs >= 5.17); pip install -r "
                                  "requirements.txt (the tested versions), or upgrade just these")
