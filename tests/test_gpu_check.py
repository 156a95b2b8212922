"""scripts/measure/gpu_check.py and tests/gpu/ on a machine without CUDA: the GPU suite is skipped with its
reason, and the entry point still writes its summary. (On a GPU they run for real.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, long_test

sys.path.insert(0, str(REPO / "scripts" / "measure"))
import gpu_check  # noqa: E402

CORE_NAMES = {case.partition("::")[2] for case in gpu_check.CORE_CASES}

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-side behaviour")


def test_the_entry_point_writes_a_summary_with_every_gpu_case_skipped_and_why(tmp_path):
    done = subprocess.run([sys.executable, "scripts/measure/gpu_check.py", "--parts", "recipes", "--results", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((tmp_path / "results.json").read_text())
    cases = record["results"]["recipes"]["cases"]
    # 3 recipes x 13 configs (those a recipe refuses are skipped with the reason), less the 9 of the core part
    assert len(cases) == 30 and not {case["name"] for case in cases} & CORE_NAMES
    assert all(case["outcome"].startswith("skipped: ") for case in cases)
    assert any("needs a CUDA GPU" in case["outcome"] for case in cases)
    summary = (tmp_path / "summary.md").read_text()
    assert "test_recipe_on_gpu[lora-zero2]" in summary and (tmp_path / "log.txt").exists()


def test_recorded_figures_become_table_columns(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite><testcase name="t[a]" time="2.5"><properties>'
                     '<property name="ratio" value="1.07"/></properties></testcase>'
                     '<testcase name="t[b]" time="1"><failure message="planned 3.0 GiB, measured 4.0 GiB"/></testcase>'
                     '<testcase time="0.001" />'  # pytest's entry for a Ctrl-C at the part's time
                     '</testsuite></testsuites>')
    cases = gpu_check.junit_cases(junit)
    assert cases[0] == {"name": "t[a]", "outcome": "passed", "seconds": 2.5, "ratio": "1.07"}
    assert cases[1]["outcome"] == "failure: planned 3.0 GiB, measured 4.0 GiB" and len(cases) == 2
    record = {"date": "d", "parts": "planner", "commit": "c", "environment": {"gpu": "G", "gpus": 1},
              "results": {"planner": {"returncode": 1, "seconds": 3, "cases": cases}}}
    table = gpu_check.summary_markdown(record)
    assert "| case | outcome | s | ratio |" in table and "| t[a] | passed | 2 | 1.07 |" in table


def test_unknown_parts_are_refused():
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--parts", "recipes,everything"])


def test_the_core_part_is_the_three_recipes_under_ddp_fsdp_and_zero3(tmp_path):
    done = subprocess.run([sys.executable, "scripts/measure/gpu_check.py", "--parts", "core", "--results", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    cases = json.loads((tmp_path / "results.json").read_text())["results"]["core"]["cases"]
    assert {case["name"] for case in cases} == CORE_NAMES and len(CORE_NAMES) == 9
    assert {"test_recipe_on_gpu[qlora-zero3]", "test_recipe_on_gpu[full-ddp]"} <= CORE_NAMES


def test_the_preference_part_runs_each_preference_recipe_under_sharding_and_ddp(tmp_path):
    done = subprocess.run([sys.executable, "scripts/measure/gpu_check.py", "--parts", "preference", "--results", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    cases = json.loads((tmp_path / "results.json").read_text())["results"]["preference"]["cases"]
    names = [case["name"] for case in cases]
    assert names[:3] == ["test_preference_recipe_on_gpu[dpo-fsdp]", "test_preference_recipe_on_gpu[dpo_full-zero3]",
                         "test_preference_recipe_on_gpu[dpo-qlora-zero3]"] and len(names) == 10
    assert names[-4:] == ["test_kto_recipe_on_gpu[kto-fsdp]", "test_kto_recipe_on_gpu[kto_full-zero3]",
                          "test_reward_model_on_gpu[reward-fsdp]", "test_reward_model_on_gpu[reward_full-zero3]"]
    assert all("needs a CUDA GPU" in case["outcome"] for case in cases)


def test_a_part_the_budget_has_no_time_for_is_not_started_and_says_why(tmp_path):
    done = subprocess.run([sys.executable, "scripts/measure/gpu_check.py", "--parts", "headline,core", "--budget-s", "40",
                           "--results", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [results[part]["returncode"] for part in ("headline", "core")] == ["not started", "not started"]
    assert "s needed" in results["core"]["why"]
    assert "headline\n\nnot started: " in (tmp_path / "summary.md").read_text()


def test_wheels_already_installed_on_a_warm_box_are_not_installed_again(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "example-1.0-py3-none-any.whl").write_bytes(b"")
    site = tmp_path / "site"
    monkeypatch.setattr(gpu_check, "SITE", site)
    site.mkdir()
    (site / "installed-wheels.json").write_text(json.dumps(["example-1.0-py3-none-any.whl"]))
    ran = []
    monkeypatch.setattr(gpu_check, "run", lambda command, *a, **k: ran.append(command) or {"returncode": 0, "seconds": 1})
    assert gpu_check.install_wheels(wheels, log=None)["already_installed"] and not ran
    (wheels / "other-2.0-py3-none-any.whl").write_bytes(b"")
    assert gpu_check.install_wheels(wheels, log=None)["returncodes"] == [0] and len(ran) == 1


@long_test
def test_a_part_past_its_time_is_interrupted_and_keeps_what_it_wrote(tmp_path, monkeypatch):
    """Ctrl-C first (pytest writes its junit XML on it), then the whole process group is killed."""
    monkeypatch.setattr(gpu_check, "STOP_GRACE_S", 2)
    script = tmp_path / "slow.py"
    script.write_text("import signal, sys, time, subprocess\n"  # the Ctrl-C handler first: a busy machine may be slow
                      "def interrupted(*_):\n    open(sys.argv[2], 'w').write('interrupted')\n    time.sleep(600)\n"
                      "signal.signal(signal.SIGINT, interrupted)\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                      "open(sys.argv[1], 'w').write(str(child.pid))\n"
                      "time.sleep(600)\n")
    pid_file, note = tmp_path / "pid", tmp_path / "note"
    with open(tmp_path / "log", "w") as log:  # 15 s: ample time to start, even on a busy machine
        result = gpu_check.run([sys.executable, str(script), str(pid_file), str(note)], log, timeout=15)
    assert result["returncode"] == "timeout" and note.read_text() == "interrupted"
    child = Path(f"/proc/{int(pid_file.read_text())}")

    def gone() -> bool:  # ended (a zombie until its new parent reaps it), or reaped
        try:
            return (child / "stat").read_text().split()[2] in ("Z", "X")
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + 10  # SIGKILL takes effect asynchronously
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone()


def test_the_commit_comes_from_the_file_written_beside_the_wheels(tmp_path):
    """A GPU box may run the tree without git, or with a stale .git: the COMMIT file, written here, wins."""
    (tmp_path / "COMMIT").write_text("abc1234\n")
    assert gpu_check.commit_of(tmp_path).startswith("abc1234 ")
    assert gpu_check.commit_of(None) not in ("", "abc1234")


def test_the_default_call_is_the_first_calls_parts_within_the_budget_and_the_files_brought_back():
    args = gpu_check.parse_args([])
    parts = args.parts.split(",")
    assert parts == ["headline", "headline_compiled_cold", "headline_compiled_warm", "trl", "speed", "codellama",
                     "preference", "grpo", "core"]
    assert args.budget_s == 540
    benchmark_files = sum(1 + (part in gpu_check.CHARTS) for part in parts if part in gpu_check.BENCHMARKS)
    step_tables = sum(part in gpu_check.STEP_TABLES for part in parts)
    # summary.md, results.json, log.txt, each step table's .json and each benchmark's .json (and .png if charted)
    assert 3 + step_tables + benchmark_files <= 8


@long_test
def test_the_default_call_rehearsed_on_cpu_writes_every_part_in_at_most_eight_files(tmp_path):
    """The one GPU call, end to end on CPU stand-ins (~4 min on 2 cores): every part runs, and what comes
    back fits the device tool's 8 files, none deeper than 2 folders."""
    done = subprocess.run([sys.executable, "scripts/measure/gpu_check.py", "--cpu-stand-in", "--results", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert list(results) == list(gpu_check.FIRST_CALL)
    assert all(result["returncode"] == 0 for result in results.values()), results
    core = {case["name"]: case["outcome"] for case in results["core"]["cases"]}
    assert core and all(outcome == "passed" for outcome in core.values()), core
    written = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert len(written) <= 8 and all(len(path.relative_to(tmp_path).parts) <= 3 for path in written)
