"""Reward functions written in Python, as GRPO takes them: found in the user's file before the model loads, and
called on each step's completions with their output checked, each failure one line naming the function and file.

The signature is TRL's: `fn(prompts, completions, **columns) -> list[float | None]`, one value per completion
(None: the function does not apply to it). `prompts` and `completions` are strings for text prompts, lists of
chat messages for conversational ones; every other column of the dataset arrives as a keyword list aligned with
them, and `completion_ids` (the completion's token ids) too. A reward written for TRL or open-r1 runs as written.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .paths import REPO_ROOT
from .refusal import refuse

# The bundled prompts' reward (data/prompts/): the completion equals the row's `answer`
BUNDLED_REWARD = f"{REPO_ROOT / 'recipes' / 'rewards.py'}:exact_answer"


@dataclass(frozen=True)
class Reward:
    name: str  # as metrics.jsonl names it: rewards/<name>/mean
    spec: str  # FILE.py:NAME as given
    function: Callable


def load_rewards(specs: list[str]) -> list[Reward]:
    """Each `FILE.py:NAME` imported and its function found; a missing file, a file that fails to import, a
    missing or uncallable name: refused in one line. The same file given twice is imported once."""
    modules = {}
    rewards = []
    for spec in specs:
        file, name = reward_file(spec)
        path = spec.rpartition(":")[0]
        key = str(file.resolve())
        if key not in modules:
            modules[key] = imported(file, spec)
        function = getattr(modules[key], name, None)
        if function is None:
            defined = sorted(attr for attr, value in vars(modules[key]).items()
                             if inspect.isfunction(value) and value.__module__ == modules[key].__name__)
            refuse(f"--reward {spec}: {path} defines no `{name}`"
                   + (f" (its functions: {', '.join(defined)})" if defined else ""))
        if not callable(function):
            refuse(f"--reward {spec}: `{name}` in {path} is not a function")
        rewards.append(Reward(name if [r.name for r in rewards].count(name) == 0 else f"{name}_{len(rewards)}",
                              spec, function))
    return rewards


def reward_file(spec: str) -> tuple[Path, str]:
    """(the file, the function's name) of a `FILE.py:NAME` spec whose file exists; anything else refused."""
    path, colon, name = spec.rpartition(":")
    if not colon or not path or not name:
        refuse(f"--reward {spec}: give FILE.py:NAME, the file with your reward function and its name")
    file = Path(path).expanduser()
    if not file.is_file():
        refuse(f"--reward {spec}: {path} does not exist; give the Python file that defines {name}")
    return file, name


def imported(file: Path, spec: str):
    """The user's file as a module (its folder on the path, so its own imports resolve)."""
    module_name = f"rewards_{abs(hash(str(file.resolve())))}"
    loader = importlib.util.spec_from_file_location(module_name, file)
    if loader is None:
        refuse(f"--reward {spec}: {file} is not a Python file")
    module = importlib.util.module_from_spec(loader)
    sys.path.insert(0, str(file.resolve().parent))
    try:
        loader.loader.exec_module(module)
    except Exception as error:  # the user's code: its own error, where it happened, in one line
        refuse(f"--reward {spec}: importing {file} failed: {type(error).__name__}: {error}{where(error, file)}")
    finally:
        sys.path.remove(str(file.resolve().parent))
    return module


def weights_of(text: str | None, rewards: list[Reward]) -> list[float]:
    """--reward-weights as one number per reward (1 each by default)."""
    if text is None:
        return [1.0] * len(rewards)
    try:
        weights = [float(part) for part in text.split(",")]
    except ValueError:
        refuse(f"--reward-weights {text}: give numbers separated by commas, one per --reward")
    if len(weights) != len(rewards):
        refuse(f"--reward-weights has {len(weights)} weight(s) for {len(rewards)} --reward function(s); give one each")
    if not all(math.isfinite(weight) for weight in weights):
        refuse(f"--reward-weights {text}: every weight must be a finite number")
    return weights


class RewardProblem(ValueError):
    """A reward function failed on this rank's completions: the one line that says how (`score`)."""


def score(rewards: list[Reward], prompts: list, completions: list, columns: dict) -> list[list[float]]:
    """[completion][reward] values (NaN where a function returned None), each function called once on all the
    completions. A function that raises, returns another count, or a value that is no number: RewardProblem,
    naming it (the recipe saves what it keeps, then every rank stops with the line)."""
    table = []
    for reward in rewards:
        try:
            values = reward.function(prompts=prompts, completions=completions, **columns)
        except Exception as error:
            file = Path(reward.spec.rpartition(":")[0])
            raise RewardProblem(f"--reward {reward.spec} raised {type(error).__name__}: {error}{where(error, file)}")
        if values is None or isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
            raise RewardProblem(f"--reward {reward.spec} returned {type(values).__name__}; return a list with one "
                                f"number (or None) per completion ({len(completions)} here)")
        values = list(values)
        if len(values) != len(completions):
            raise RewardProblem(f"--reward {reward.spec} returned {len(values)} values for {len(completions)} "
                                "completions; return one per completion")
        column = []
        for index, value in enumerate(values):
            if value is None:
                column.append(math.nan)
                continue
            try:
                number = None if isinstance(value, (str, bytes)) else float(value)
            except (TypeError, ValueError):
                number = None
            if number is None or not math.isfinite(number):
                raise RewardProblem(f"--reward {reward.spec} returned {value!r} for completion {index}; return a "
                                    "finite number, or None where the reward does not apply")
            column.append(number)
        table.append(column)
    return [list(row) for row in zip(*table)]


def where(error: BaseException, file: Path) -> str:
    """` (FILE:LINE)`: the last line of the user's file in the error's traceback, if any."""
    try:
        resolved = str(file.resolve())
        frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == resolved]
    except Exception:
        return ""
    return f" ({file}:{frames[-1].lineno})" if frames else ""
