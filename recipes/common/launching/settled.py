"""The settled run: one read-only object holding what a launch runs with.

A recipe's flags are settled once, before the model loads: the command line and the --config run
file first (`args.parse_args`), then what the user's accelerate or DeepSpeed file fixes
(`launch_config`, `deepspeed_config`) and the batch-size rules (`batch_size`). Each of those steps
returns a new `Run` (`Run.settled`) instead of writing to the one it was given, so a value never
changes behind a reader's back, and every value a file or a rule changed is listed once, with its
source, in `settled_from` (run.json's `arguments` shows it).
"""

from __future__ import annotations

import argparse
import copy

# What a run holds besides its flags, each filled by the step named:
RECORDS = {
    "given_flags": [],  # flags typed, set in --config, or fixed by the accelerate / DeepSpeed file (args, settle steps)
    "settled_from": {},  # flag -> what set it, when a file or a rule changed it (every settle step)
    "batch_plan": {},  # --batch-size auto / --global-batch-size: what was asked and planned (batch_size.settle)
    "deepspeed_scheduler": None,  # a DeepSpeed config's `scheduler` section, run as it asks (deepspeed_config)
    "quantization_plan": None,  # the share of the base's weights bitsandbytes quantizes (qlora; settle_launch)
}


class Run(argparse.Namespace):
    """A launch's settings, read-only: `run.lr` is the learning rate that trains, whatever set it."""

    def __init__(self, **values):
        for name, value in {**copy.deepcopy(RECORDS), **values}.items():  # no default shared between runs
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, namespace: argparse.Namespace) -> Run:
        """A parsed namespace (or a run) as a run."""
        return namespace if isinstance(namespace, Run) else cls(**vars(namespace))

    def __setattr__(self, name, value):
        raise AttributeError(f"the run is settled before the model loads and read-only after; `{name}` is set by "
                             "returning run.settled(...) from a settle step")

    def __delattr__(self, name):
        raise AttributeError(f"the run is read-only; `{name}` cannot be deleted")

    def settled(self, changes: dict[str, tuple[object, str]], fixes_flags: bool = False) -> Run:
        """A new run with `changes` ({flag: (value, what set it)}) applied and listed in `settled_from`.
        `fixes_flags`: a file set them, so later rules treat them as given (a typed flag may not contradict them)."""
        values = {name: value for name, (value, _) in changes.items()}
        sources = {name: source for name, (_, source) in changes.items()}
        given = sorted(set(self.given_flags) | set(changes)) if fixes_flags else self.given_flags
        return Run(**{**vars(self), **values, "given_flags": given, "settled_from": {**self.settled_from, **sources}})

    def recorded(self, **records) -> Run:
        """A new run that also holds `records` (names from RECORDS: what a settle step found, for run.json)."""
        unknown = set(records) - set(RECORDS)
        if unknown:
            raise TypeError(f"not a record of a run: {', '.join(sorted(unknown))} (RECORDS lists them)")
        return Run(**{**vars(self), **records})
