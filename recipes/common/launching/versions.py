"""The library versions the recipes run on.

`requirements.txt` pins the versions every test runs on; `LOWEST` are the oldest ones the recipes are
tested with (those of the GPU box this project measures on, and the oldest peft and datasets that run
beside them; `requirements-lowest.txt`). An older library is named before anything loads, since what
fails on it fails late and far from the cause (a missing method after the model is built).
"""

from __future__ import annotations

LOWEST = {
    "torch": "2.11",
    "transformers": "5.17",
    "accelerate": "1.15",
    "huggingface_hub": "1.33",
    "peft": "0.18",
    "datasets": "4.7",
}


def older_than(installed: str, version: str) -> bool:
    """Whether `installed` is older than `version` (a pre-release or local build counts as its release)."""
    from packaging.version import Version

    return Version(Version(installed).base_version) < Version(version)


def older_than_lowest(name: str, installed: str) -> bool:
    """Whether `installed` (a version of the library `name` in LOWEST) is older than the lowest supported."""
    return older_than(installed, LOWEST[name])


def too_old() -> list[str]:
    """'name found (needs >= lowest)' for each installed library older than LOWEST."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name, lowest in LOWEST.items():
        try:
            installed = version(name)
        except PackageNotFoundError:  # a missing library fails at its import, with Python's own message
            continue
        if older_than_lowest(name, installed):
            found.append(f"{name} {installed} (needs >= {lowest})")
    return found
