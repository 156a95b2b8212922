"""scripts/measure/benchmark.py (and scripts/measure/bench/): the CPU smoke run end to end, and the arithmetic behind its numbers.

No timing is asserted: only that the numbers are there, have the right units and obey the rules.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "measure"))
from bench.flops import (  # noqa: E402
    CPU_NOMINAL_PEAK_TFLOPS,
    flop_per_token,
    matmul_parameters,
    table_peak,
)
from bench.gpu_monitor import LaunchMonitor  # noqa: E402
from bench.reference import reference_rows  # noqa: E402
from bench.report import write_results  # noqa: E402
from bench.shapes import shape_of  # noqa: E402
from bench.timing import summarise_metrics, training_wall_time  # noqa: E402
from bench.workloads import WORKLOADS  # noqa: E402

REFERENCE_CELLS = ("3 min 53 s", "59 s", "47 min", "30 min", "24%", "90%", "~20%", "~100%", "RTX 6000 Ada")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    output = tmp_path_factory.mktemp("benchmark")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "measure" / "benchmark.py"), "--smoke", "--strategies", "ddp",
                           "--output-dir", str(output)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    folders = [path.parent for path in output.glob("*/results.json")]
    assert len(folders) == 1, list(output.iterdir())
    return done.stdout, folders[0], output


def test_smoke_writes_results_table_and_chart(smoke):
    stdout, folder, _ = smoke
    assert folder.name.startswith(tuple("0123456789")) and "_cpu-smoke_torch" in folder.name
    assert "_transformers" in folder.name
    for name in ("results.md", "results.json", "chart.png"):
        assert (folder / name).stat().st_size > 0, name
    assert (folder / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (folder / "results.md").read_text()
    for cell in REFERENCE_CELLS:  # the reference rows, beside ours
        assert cell in table, cell
        assert cell in stdout, cell  # the table is printed at the end
    assert "| DDP | ours (2 CPU processes)" in table


def test_smoke_row_numbers(smoke):
    _, folder, output = smoke
    results = json.loads((folder / "results.json").read_text())
    rows = results["rows"]
    assert [row["strategy"] for row in rows] == ["ddp"]
    row = rows[0]
    assert row["status"] == "ok"
    # 64 rows of exactly 64 tokens: 63 targets each (the BOS is not one); batch 2 x GA 2 x 2 processes.
    assert row["tokens"] == 64 * 63
    assert row["steps"] == 8
    assert row["tokens_per_s_per_gpu"] > 0
    assert 0 < row["mfu"] < 1
    assert row["utilisation"] == pytest.approx(row["mfu"])  # no gradient checkpointing
    assert 0 < row["wall_s"] <= row["end_to_end_s"]
    assert row["wall_rule"] == "first step replaced by the median"
    assert row["gpu_util"] is None and row["peak_allocated_gib"] is None  # CPU: n/a
    assert results["environment"]["peak_tflops"] == CPU_NOMINAL_PEAK_TFLOPS
    assert "accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2" in row["command"]
    for flag in ("--epochs 1", "--max-length 64", "--report-to none", "--log-every 0", "--eval-every 0"):
        assert flag in row["command"]
    # The data: a `text` column, 64 rows in the training split.
    train = (output / "data" / "text-64x64" / "train.jsonl").read_text().splitlines()
    assert len(train) == 64 and all("text" in json.loads(line) for line in train)


def test_help_runs():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "measure" / "benchmark.py"), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "--measure-peak" in done.stdout and "--layers" in done.stdout


# ------------------------------------------------------------------ FLOP per token

def test_flop_per_token_tinyllama():
    shape = shape_of(WORKLOADS["tinyllama"].config)
    n = matmul_parameters(shape)
    assert n == pytest.approx(1.034e9, rel=1e-3)
    flop = flop_per_token(shape, 1024)
    assert flop == 4 * n + 12 * 22 * 2048 * 1024
    assert flop * 1_048_576 == pytest.approx(4.9e15, rel=0.01)  # one epoch, LoRA
    assert flop_per_token(shape, 1024, recompute=True) == 6 * n + 16 * 22 * 2048 * 1024


def test_flop_per_token_codellama34b():
    shape = shape_of(WORKLOADS["codellama34b"].config)
    n = matmul_parameters(shape)
    assert n == pytest.approx(3.348e10, rel=1e-3)
    assert flop_per_token(shape, 1024) * 1_048_576 == pytest.approx(1.46e17, rel=0.01)
    # Fewer layers: the per-layer part shrinks, the lm_head stays.
    reduced = shape_of(WORKLOADS["codellama34b"].config, layers=12)
    assert reduced.layers == 12
    assert flop_per_token(reduced, 1024) == pytest.approx(
        flop_per_token(shape, 1024) - 36 * (4 * sum(shape.linear_parameters_per_layer().values())
                                                      + 12 * 8192 * 1024))


def test_reference_mfu_matches_the_notes():
    refs = {(r["workload"], r["strategy"]): r for r in reference_rows()}
    assert refs["tinyllama", "ddp"]["mfu"] == pytest.approx(0.057, abs=0.001)
    assert refs["codellama34b", "fsdp"]["mfu"] == pytest.approx(0.055, abs=0.001)


def test_peak_table():
    assert table_peak("NVIDIA H100 80GB HBM3")[0] == 989
    assert table_peak("NVIDIA H100 PCIe")[0] == 756
    assert table_peak("NVIDIA H200")[0] == 989
    assert table_peak("NVIDIA A100-SXM4-80GB")[0] == 312
    assert table_peak("NVIDIA RTX 6000 Ada Generation")[0] == 364
    assert table_peak("NVIDIA L40S")[0] == 362
    assert table_peak("Some Future GPU") is None


# ------------------------------------------------------------------ the wall-time rule

def test_wall_time_replaces_the_first_step_by_the_median():
    # first step 5 s (warm-up), then steps of 1.0, 1.1, 0.9, 1.2 s: median 1.05
    result = training_wall_time([5.0, 6.0, 7.1, 8.0, 9.2])
    assert result["median_step_s"] == pytest.approx(1.05)
    assert result["wall_s"] == pytest.approx(9.2 - 5.0 + 1.05)
    assert result["steps"] == 5


def test_wall_time_single_step_and_metrics_summary():
    assert training_wall_time([3.5])["wall_s"] == 3.5
    with pytest.raises(ValueError):
        training_wall_time([])
    lines = [
        {"type": "train", "step": 2, "tokens": 100, "elapsed_s": 4.0, "loss": 2.0, "peak_allocated_gib": 3.0,
         "peak_reserved_gib": 4.0},
        {"type": "eval", "step": 3, "eval_loss": 1.0},
        {"type": "train", "step": 1, "tokens": 100, "elapsed_s": 3.0, "loss": 2.5, "peak_allocated_gib": 2.0,
         "peak_reserved_gib": 5.0},
        {"type": "train", "step": 3, "tokens": 50, "elapsed_s": 5.0, "loss": 1.5, "peak_allocated_gib": 1.0,
         "peak_reserved_gib": 4.5},
    ]
    summary = summarise_metrics(lines)
    assert summary["tokens"] == 250 and summary["steps"] == 3
    assert summary["wall_s"] == pytest.approx(5.0 - 3.0 + 1.0)
    assert (summary["peak_allocated_gib"], summary["peak_reserved_gib"]) == (3.0, 5.0)


# ------------------------------------------------------------------ GPU-only paths, with made-up numbers

def test_utilisation_is_averaged_over_the_training_steps(tmp_path):
    monitor = LaunchMonitor(None, tmp_path / "metrics.jsonl")
    # loading at 0% and 10%, training at 80% / 100% on two GPUs, the export at 5%
    monitor.samples = [(t, [(u, 1.0), (u2, 2.0)]) for t, u, u2 in
                       [(0, 0, 0), (1, 10, 10), (2, 80, 100), (3, 80, 100), (4, 80, 100), (5, 5, 5)]]
    monitor.step_seen = {1: 2.0, 2: 3.0, 3: 4.0}
    result = monitor.training_utilisation(wall_s=3.0)
    assert result["gpu_util"] == pytest.approx(0.9)
    assert result["gpu_util_per_gpu"] == [0.8, 1.0]
    assert result["gpu_used_gib_max"] == 2.0
    assert LaunchMonitor(None, tmp_path / "x").training_utilisation(1.0)["gpu_util"] is None


def test_table_and_chart_with_gpu_rows(tmp_path):
    common = {"gpus": 4, "device": "4x NVIDIA H100 80GB HBM3", "full_layers": 48, "status": "ok",
              "tokens_per_s_per_gpu": 500.0, "mfu": 0.2, "utilisation": 0.2, "gpu_util": 0.95,
              "peak_allocated_gib": 40.0, "peak_reserved_gib": 44.0, "command": "accelerate launch ..."}
    rows = [
        {**common, "workload": "codellama34b", "workload_label": WORKLOADS["codellama34b"].label,
         "strategy": "fsdp", "strategy_label": "FSDP", "layers": 12, "wall_s": 300.0,
         "scaled_estimate": {"layers": 48, "factor": 3.9, "wall_s": 1170.0, "tokens_per_s_per_gpu": 128.2,
                             "method": "estimate, not measured"}},
        {**common, "workload": "codellama34b", "workload_label": WORKLOADS["codellama34b"].label,
         "strategy": "zero3", "strategy_label": "ZeRO-3", "layers": 12, "status": "failed",
         "error": "exit 1: CUDA out of memory"},
        {**common, "workload": "tinyllama", "workload_label": WORKLOADS["tinyllama"].label,
         "strategy": "ddp", "strategy_label": "DDP", "layers": 22, "full_layers": 22, "wall_s": 29.5},
    ]
    environment = {"date": "2025-01-01", "device_label": "4x NVIDIA H100 80GB HBM3", "devices": 4,
                   "peak_tflops": 989.0, "peak_source": "table", "measured_tflops": None,
                   "versions": {"torch": "x", "transformers": "y"}}
    write_results(tmp_path, environment, rows)
    table = (tmp_path / "results.md").read_text()
    assert "12 of 48 layers" in table and "ESTIMATE for 48 layers" in table and "not measured" in table
    assert "failed: exit 1: CUDA out of memory" in table
    assert "2.00x faster" in table  # DDP: 59 s reference / 29.5 s
    assert "95.0%" in table and "40.0 / 44.0" in table
    assert (tmp_path / "chart.png").stat().st_size > 0
    # A later run of another workload in the same folder keeps these rows.
    write_results(tmp_path, environment, [{**rows[2], "strategy": "zero2", "strategy_label": "ZeRO-2"}])
    assert len(json.loads((tmp_path / "results.json").read_text())["rows"]) == 4
