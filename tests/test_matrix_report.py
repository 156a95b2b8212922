"""scripts/measure/matrix_report.py turns a test run's JUnit XML into README's recipe x config tables."""

from __future__ import annotations

import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "measure"))
import matrix_report  # noqa: E402

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
  <testcase classname="tests.test_matrix" name="test_recipe_runs_strategy[lora-ddp]" time="1.0">
    <properties><property name="launch_seconds" value="15.4" /></properties></testcase>
  <testcase classname="tests.test_matrix" name="test_recipe_runs_strategy[full-zero2]" time="0.0">
    <skipped message="a long test" /></testcase>
  <testcase classname="tests.test_matrix" name="test_recipe_runs_strategy[qlora-fsdp]" time="1.0">
    <failure message="boom" /></testcase>
  <testcase classname="tests.test_equivalence" name="test_same_loss_curve_as_one_process[lora-zero3]" time="1.0">
    <properties><property name="max_relative_difference" value="9.5e-08" /></properties></testcase>
  <testcase classname="tests.test_equivalence" name="test_same_loss_curve_as_one_process[full-ddp]" time="1.0">
    <properties><property name="max_relative_difference" value="0.0" /></properties></testcase>
</testsuite></testsuites>
"""


def test_tables_show_values_skips_and_failures(tmp_path, capsys):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    assert matrix_report.main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    seconds, differences = [i for i, line in enumerate(lines) if line.startswith("| recipe |")]
    header = lines[seconds].split(" | ")
    lora = lines[seconds + 3].split(" | ")  # header, separator, full, lora
    assert lora[header.index("ddp")] == "15 s" and lora[header.index("model_parallel")] == "not run"
    assert lines[seconds + 2].split(" | ")[header.index("zero2")] == "skipped"
    assert lines[seconds + 4].split(" | ")[header.index("fsdp")] == "failed"
    header = lines[differences].split(" | ")
    assert "model_parallel" not in header
    assert lines[differences + 3].split(" | ")[header.index("zero3")] == "9.5e-08"
    assert lines[differences + 2].split(" | ")[header.index("ddp")] == "0"


def test_an_unreadable_file_is_one_line(tmp_path, capsys):
    path = tmp_path / "junit.xml"
    path.write_text("<testsuites>")
    assert matrix_report.main([str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot read {path}")
