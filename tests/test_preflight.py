"""Launches that cannot work stop before the model loads, with one line naming the fix."""

from __future__ import annotations

from conftest import assert_no_traceback_of_ours, launch


def refusal_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def test_model_parallel_with_two_processes_is_refused(tmp_path):
    run = launch("lora", tmp_path / "out", "--max-steps", "1", config="model_parallel", processes=2)
    assert run.returncode != 0, run.output[-3000:]
    [line] = refusal_lines(run.output)
    assert "ONE process" in line and "fsdp.yaml" in line and "ddp.yaml" in line
    assert_no_traceback_of_ours(run.output)
    assert not (tmp_path / "out" / "run.json").exists()


def test_eight_bit_under_fsdp_is_refused(tmp_path):
    run = launch("qlora", tmp_path / "out", "--bits", "8", "--max-steps", "1", config="fsdp", processes=2)
    assert run.returncode != 0
    lines = refusal_lines(run.output)
    assert len(lines) == 1 and "8-bit" in lines[0] and "--bits 4" in lines[0], run.output[-3000:]
    assert_no_traceback_of_ours(run.output)


def test_missing_dataset_is_refused(tmp_path):
    run = launch("full", tmp_path / "out", "--dataset", str(tmp_path / "nope.jsonl"), "--max-steps", "1")
    assert run.returncode != 0
    [line] = refusal_lines(run.output)
    assert "nope.jsonl does not exist" in line
