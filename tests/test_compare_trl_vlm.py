"""scripts/measure/compare_trl_vlm.py: recipes/lora.py beside TRL's SFTTrainer on rows with images. The table is built
from the runs' records, the two sides get the same flags; the end-to-end run (long) checks that both trained on the same
target tokens from the same step-1 loss. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, long_test

sys.path.insert(0, str(REPO / "scripts" / "measure"))
import compare_trl_vlm  # noqa: E402


def launched(step_s: float, end_to_end_s: float, load: float, first_loss: float = 6.0) -> dict:
    """What compare_trl.launched returns for a run of 3 steps of 100 target tokens."""
    records = [{"type": "train", "step": step, "tokens": 100, "elapsed_s": 1.0 + (step - 1) * step_s}
               for step in (1, 2, 3)]
    records[0]["loss"] = first_loss
    lines = [(0.5, "plan: ..."), (2.0, "lora: MULTI_CPU x 2 process(es)"), (2.5, "trl: training"), (9.0, "done")]
    return {"records": records + [{"type": "eval", "step": 3, "eval_loss": 5.0}], "end_to_end_s": end_to_end_s,
            "stdout_lines": lines, "cpu_busy_before": 0.5, "load_1min_before": load}


def test_the_table_is_built_from_the_runs_records():
    runs = [compare_trl_vlm.record_of(side, 2, round_number, launched(step_s, end_to_end_s, load))
            for side, round_number, step_s, end_to_end_s, load in (
                ("ours", 1, 0.1, 20.0, 1.0), ("trl", 1, 0.2, 30.0, 2.0), ("trl", 2, 0.4, 40.0, 3.0),
                ("ours", 2, 0.3, 10.0, 4.0), ("ours", 3, 0.2, 30.0, 5.0), ("trl", 3, 0.3, 35.0, 6.0))]
    assert runs[0]["step_s"] == pytest.approx(0.1) and runs[0]["tokens_per_s"] == pytest.approx(1000)
    assert runs[0]["median_step_s"] == pytest.approx(0.1)
    assert runs[0]["step1_loss"] == 6.0 and runs[0]["step_tokens"] == [100, 100, 100]
    # the launch to the line where each side's clock starts, its clock at the last step, the rest
    assert (runs[0]["before_loop_s"], runs[0]["loop_s"], runs[0]["after_loop_s"]) == pytest.approx((2.0, 1.2, 16.8))
    assert runs[1]["before_loop_s"] == 2.5 and runs[1]["after_loop_s"] == pytest.approx(30 - 2.5 - 1.4)
    (row,) = compare_trl_vlm.summarise(runs)
    assert row["processes"] == 2 and row["rounds"] == 3
    assert row["ours_step_s"] == pytest.approx(0.2) and row["trl_step_s"] == pytest.approx(0.3)
    assert row["ours_step_s_spread"] == pytest.approx(1.0)  # (0.3 - 0.1) / 0.2
    assert row["tokens_per_s_ratio"] == pytest.approx(1.5)  # 500 / 333.3 target tokens a second
    assert row["end_to_end_ratio"] == pytest.approx(20 / 35)
    assert row["load_1min"] == (1.0, 3.5, 6.0)
    table = compare_trl_vlm.table([row]).splitlines()
    assert len(table) == 3 and table[0].count("|") == table[2].count("|")
    # the rounds' own ratios: 0.2 / 0.1, 0.4 / 0.3, 0.3 / 0.2 s a step; 20 / 30, 10 / 40, 30 / 35 s end to end
    assert row["paired_tokens_per_s_ratio"] == pytest.approx(1.5) and row["paired_end_to_end_ratio"] == pytest.approx(2 / 3)
    assert row["paired_median_step_ratio"] == pytest.approx(1.5)
    assert table[2].startswith("| 2 | 3 | 0.2000 (100%) | 0.3000 (67%) | 500 (") and "1.50; **1.50**" in table[2]
    assert "| 0.2000 (100%) | 0.3000 (67%) | **1.50** |" in table[2] and "0.57; **0.67**" in table[2]
    parts = compare_trl_vlm.parts_table([row]).splitlines()
    assert parts[2] == "| 2 | ours | 2.0 | 1.4 | 16.8 | 20.0 |"  # medians of each part over the rounds
    assert "| 20.0 (" in table[2] and "| 35.0 (" in table[2] and "| 6.000000 | 6.000000 | 1.00 / 3.50 / 6.00 |" in table[2]


def test_both_sides_get_the_same_workload(tmp_path):
    args = compare_trl_vlm.parse_args(["--model", "models/tiny-llava", "--steps", "7", "--batch-size", "4"])
    assert args.processes == [1, 2]
    ours, trl = (compare_trl_vlm.launch_command(side, tmp_path, args, 2) for side in ("ours", "trl"))
    program = ours.index(str(compare_trl_vlm.SIDES["ours"][1]))
    assert ours[:program][:-2] == trl[:program][:-2]  # the launcher's flags, its port apart
    assert trl[program] == str(compare_trl_vlm.SIDES["trl"][1])
    shared = ["--model", "models/tiny-llava", "--dataset", "data/vision", "--max-steps", "7", "--batch-size", "4"]
    for command in (ours, trl):
        assert all(command[command.index(flag) + 1] == value for flag, value in zip(shared[::2], shared[1::2]))
        assert command[command.index("--num_processes") + 1] == "2"
    assert "--recipe-order" in trl and "--recipe-order" not in ours


@long_test  # two launches of each side (~2 min on 2 cores)
def test_both_sides_train_the_same_tokens_from_the_same_loss(tmp_path):
    done = subprocess.run([sys.executable, "scripts/measure/compare_trl_vlm.py", "--rounds", "1", "--steps", "3",
                           "--output-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    for processes in (1, 2):
        ours, trl = (next(run for run in summary["runs"] if run["processes"] == processes and run["side"] == side)
                     for side in ("ours", "trl"))
        assert ours["step_tokens"] == trl["step_tokens"] and len(ours["step_tokens"]) == 3
        assert ours["step1_loss"] == pytest.approx(trl["step1_loss"], abs=1e-5)
    assert done.stdout.strip().splitlines()[-1].startswith("| 2 | 1 | ")
