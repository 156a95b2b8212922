"""scripts/measure/compare_trl_grpo.py: recipes/grpo.py beside TRL's GRPOTrainer on the same workload.

The unit tests check what makes the two launches the same workload and how a run's time is split (no launch); the
end-to-end run is a long test. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, long_test

sys.path.insert(0, str(REPO / "scripts" / "measure"))
import compare_trl_grpo  # noqa: E402


def side_flags(command: list[str], program: str) -> list[str]:
    return command[command.index(program) + 1:]


def test_both_sides_get_the_same_workload_and_trl_its_own_generation(tmp_path):
    args = compare_trl_grpo.parse_args(["--steps", "5", "--top-k", "3", "--max-completion-length", "32"])
    programs = {side: str(program) for side, (_, program) in compare_trl_grpo.SIDES.items()}
    ours, trl = (compare_trl_grpo.launch_command(side, tmp_path / side, args, 2, port=29999) for side in programs)
    assert ours[:ours.index(programs["ours"])] == trl[:trl.index(programs["trl"])]  # the same launcher, both
    ours_flags, trl_flags = side_flags(ours, programs["ours"]), side_flags(trl, programs["trl"])
    shared = compare_trl_grpo.workload_flags(args)
    for flags in (ours_flags, trl_flags):
        assert flags[2:2 + len(shared)] == shared  # after --output-dir DIR
        assert flags[flags.index("--top-k") + 1] == "3" and flags[flags.index("--max-steps") + 1] == "5"
    assert "--trl-generation" in trl_flags and "--trl-generation" not in ours_flags
    assert trl_flags[trl_flags.index("--dataset") + 1].endswith("data/prompts/train.jsonl")
    assert ours_flags[ours_flags.index("--dataset") + 1] == "data/prompts"
    assert "--no-eval-on-start" in ours_flags  # TRL's worker evaluates nothing before its loop
    with_eval = compare_trl_grpo.parse_args(["--eval-on-start"])
    assert "--no-eval-on-start" not in compare_trl_grpo.launch_command("ours", tmp_path, with_eval, 1)


def test_a_file_of_prompts_goes_to_trl_as_it_is(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a", "answer": "b"}\n')
    assert compare_trl_grpo.trl_dataset(str(prompts)) == str(prompts)
    assert compare_trl_grpo.trl_dataset(str(tmp_path)) == str(tmp_path / "train.jsonl")


def launch_of(side: str, clock_at: float, eval_at: float | None, elapsed: list[float], generation: list[float]) -> dict:
    key = compare_trl_grpo.GENERATION[side]
    records = [{"type": "train", "step": step, "elapsed_s": at, key: seconds, "completions/mean_length": 60.0,
                **({"rewards_s": 0.001} if side == "trl" else {})}
               for step, (at, seconds) in enumerate(zip(elapsed, generation), 1)]
    lines = [(1.0, "plan: ..."), (clock_at, compare_trl_grpo.CLOCK_LINES[side] + "...")]
    if eval_at is not None:
        lines.append((eval_at, "eval at step 4: eval_reward 0.0000"))
    return {"records": records + [{"type": "eval", "step": 4}], "stdout_lines": lines, "end_to_end_s": 30.0,
            "load_1min_before": 2.0, "cpu_busy_before": 0.5}


def test_a_run_is_split_into_before_the_loop_the_loop_and_after_it():
    ours = compare_trl_grpo.record_of("ours", 1, 1, launch_of("ours", 10.0, 18.0, [3.0, 4.0, 6.0, 7.0],
                                                              [2.0, 0.5, 1.5, 0.7]))
    assert (ours["before_loop_s"], ours["loop_s"], ours["after_loop_s"]) == (10.0, 7.0, 13.0)
    assert ours["final_eval_s"] == pytest.approx(1.0)  # its line, after the last step's end (10 + 7)
    assert ours["median_step_s"] == pytest.approx(1.0)  # steps 2..4 took 1, 2, 1: step 1's warm-up left out
    assert ours["mean_step_s"] == pytest.approx(4 / 3)
    assert ours["median_generation_s"] == pytest.approx(0.7) and ours["median_scoring_s"] is None
    trl = compare_trl_grpo.record_of("trl", 1, 1, launch_of("trl", 12.0, None, [5.0, 6.5, 8.0, 9.5],
                                                            [3.0, 1.0, 1.0, 1.0]))
    assert trl["final_eval_s"] is None and trl["median_scoring_s"] == pytest.approx(0.001)
    rows = compare_trl_grpo.summarise([ours, trl], ours_scoring_s=0.0001)
    assert len(rows) == 1 and rows[0]["processes"] == 1
    row = rows[0]
    assert row["ours_rest_s"] == pytest.approx(1.0 - 0.7 - 0.0001)  # the step less generation and scoring
    assert row["trl_rest_s"] == pytest.approx(1.5 - 1.0 - 0.001)
    assert row["step_ratio"] == pytest.approx(1.0 / 1.5) and row["end_to_end_ratio"] == pytest.approx(1.0)
    assert "| 1 | ours |" in compare_trl_grpo.clock_table(rows) and "| 1 | TRL |" in compare_trl_grpo.step_table(rows)


@long_test  # two launches (~1 min)
def test_the_comparison_runs_end_to_end(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "measure" / "compare_trl_grpo.py"), "--steps", "3",
                           "--processes", "1", "--output-dir", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    (row,) = summary["rows"]
    for side in ("ours", "trl"):
        assert row[f"{side}_median_step_s"] > 0 and row[f"{side}_median_generation_s"] > 0
        assert (tmp_path / f"p1-round1-{side}" / "adapter" / "adapter_config.json").exists()
    assert row["ours_final_eval_s"] > 0 and row["trl_final_eval_s"] is None
