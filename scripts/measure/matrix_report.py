"""The recipe x config tables of README from a test run's JUnit XML.

    RECIPES_LONG_TESTS=1 python -m pytest -q tests/test_matrix.py tests/test_equivalence.py \\
        --junitxml results/DATE_cpu_matrix/junit.xml
    python scripts/measure/matrix_report.py results/DATE_cpu_matrix/junit.xml > results/DATE_cpu_matrix/matrix.md

Reads what the tests record (`record_property`): each matrix launch's wall time and each
strategy's largest relative loss difference against one process. A test that failed or was
skipped shows as such.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ElementTree

RECIPES = ("full", "lora", "qlora")
CONFIGS = ("model_parallel", "ddp", "fsdp", "fsdp_grad_op", "fsdp_offload", "zero1", "zero2", "zero3", "zero3_offload")
TESTS = {"test_recipe_runs_strategy": "launch_seconds", "test_same_loss_curve_as_one_process": "max_relative_difference"}


def read_cells(path: str) -> dict:
    """(test, recipe, config) -> the recorded value, or "failed" / "skipped"."""
    cells = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        match = re.fullmatch(r"(\w+)\[(\w+)-(\w+)\]", case.get("name", ""))
        if not match or match.group(1) not in TESTS:
            continue
        test, recipe, config = match.groups()
        if case.find("skipped") is not None:
            cells[test, recipe, config] = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            cells[test, recipe, config] = "failed"
        else:
            recorded = {p.get("name"): p.get("value") for p in case.iter("property")}
            cells[test, recipe, config] = float(recorded[TESTS[test]])
    return cells


def table(cells: dict, test: str, configs: tuple, form) -> list[str]:
    lines = ["| recipe | " + " | ".join(configs) + " |", "|---|" + "---|" * len(configs)]
    for recipe in RECIPES:
        values = [cells.get((test, recipe, config), "not run") for config in configs]
        lines.append(f"| `{recipe}.py` | " + " | ".join(v if isinstance(v, str) else form(v) for v in values) + " |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("junit_xml", help="written by pytest --junitxml")
    args = parser.parse_args(argv)
    try:
        cells = read_cells(args.junit_xml)
    except (OSError, ElementTree.ParseError) as error:
        print(f"error: cannot read {args.junit_xml}: {error}", file=sys.stderr)
        return 2
    lines = ["Launch wall time, seconds (tests/test_matrix.py; start-up, evaluation, export, reload check):", ""]
    lines += table(cells, "test_recipe_runs_strategy", CONFIGS, lambda v: f"{v:.0f} s")
    lines += ["", "Largest relative difference of the per-step loss against one process (tests/test_equivalence.py):", ""]
    lines += table(cells, "test_same_loss_curve_as_one_process", CONFIGS[1:], lambda v: "0" if v == 0 else f"{v:.1e}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
