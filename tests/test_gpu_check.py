"""scripts/gpu_check.py and tests/gpu/ on a machine without CUDA: the GPU suite is skipped with its
reason, and the entry point still writes its summary. (On a GPU they run for real.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-side behaviour")


def test_the_entry_point_writes_a_summary_with_every_gpu_case_skipped_and_why(tmp_path):
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--parts", "recipes", "--results", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((tmp_path / "results.json").read_text())
    cases = record["results"]["recipes"]["cases"]
    assert len(cases) == 36  # 3 recipes x 12 configs (those a recipe refuses are skipped with the reason)
    assert all(case["outcome"].startswith("skipped: ") for case in cases)
    assert any("needs a CUDA GPU" in case["outcome"] for case in cases)
    summary = (tmp_path / "summary.md").read_text()
    assert "test_recipe_on_gpu[lora-zero3]" in summary and (tmp_path / "log.txt").exists()


def test_recorded_figures_become_table_columns(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite><testcase name="t[a]" time="2.5"><properties>'
                     '<property name="ratio" value="1.07"/></properties></testcase>'
                     '<testcase name="t[b]" time="1"><failure message="planned 3.0 GiB, measured 4.0 GiB"/></testcase>'
                     '</testsuite></testsuites>')
    cases = gpu_check.junit_cases(junit)
    assert cases[0] == {"name": "t[a]", "outcome": "passed", "seconds": 2.5, "ratio": "1.07"}
    assert cases[1]["outcome"] == "failure: planned 3.0 GiB, measured 4.0 GiB"
    record = {"date": "d", "parts": "planner", "commit": "c", "environment": {"gpu": "G", "gpus": 1},
              "results": {"planner": {"returncode": 1, "seconds": 3, "cases": cases}}}
    table = gpu_check.summary_markdown(record)
    assert "| case | outcome | s | ratio |" in table and "| t[a] | passed | 2 | 1.07 |" in table


def test_unknown_parts_are_refused():
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--parts", "recipes,everything"])
