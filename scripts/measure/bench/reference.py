"""The published reference results (../shared/notes/performance.md), as rows to set beside ours."""

from __future__ import annotations

from bench.flops import flop_per_token, mfu
from bench.shapes import shape_of
from bench.workloads import STRATEGIES, WORKLOADS

# ../shared/notes/performance.md: 4x RTX 6000 Ada 48 GB (PCIe, no NVLink). LoRA rank / targets, data,
# precision and padding were not published; the MFU below assumes 1,048,576 real tokens and bf16 peak.
REFERENCE_HARDWARE = "4x RTX 6000 Ada 48 GB, PCIe"
REFERENCE_GPUS = 4
REFERENCE_PEAK_TFLOPS = 364.0
REFERENCE = (
    {"workload": "tinyllama", "strategy": "model_parallel", "wall_s": 233.0, "wall": "3 min 53 s", "gpu_util": "24%"},
    {"workload": "tinyllama", "strategy": "ddp", "wall_s": 59.0, "wall": "59 s", "gpu_util": "90%"},
    {"workload": "codellama34b", "strategy": "model_parallel", "wall_s": 47 * 60.0, "wall": "47 min",
     "gpu_util": "~20%"},
    {"workload": "codellama34b", "strategy": "fsdp", "wall_s": 30 * 60.0, "wall": "30 min", "gpu_util": "~100%"},
)
REFERENCE_TOKENS = 1024 * 1024


def reference_rows() -> list[dict]:
    rows = []
    for ref in REFERENCE:
        workload = WORKLOADS[ref["workload"]]
        shape = shape_of(workload.config)
        flop = flop_per_token(shape, workload.max_length)
        per_gpu = REFERENCE_TOKENS / ref["wall_s"] / REFERENCE_GPUS
        rows.append({**ref, "workload_label": workload.label, "strategy_label": STRATEGIES[ref["strategy"]].label,
                     "gpus": REFERENCE_GPUS, "device": REFERENCE_HARDWARE,
                     "tokens_per_s_per_gpu": round(per_gpu, 1),
                     "mfu": mfu(per_gpu, flop, REFERENCE_PEAK_TFLOPS * 1e12)})
    return rows


def find_reference(workload: str, strategy: str) -> dict | None:
    return next((ref for ref in reference_rows() if ref["workload"] == workload and ref["strategy"] == strategy), None)
