"""The devices a run uses: probed in a child process (so this one never holds a CUDA context), the GPUs
chosen among them, and the peak per device that MFU divides by."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from bench.flops import CPU_NOMINAL_PEAK_TFLOPS, table_peak
from bench.formatting import slug
from bench.paths import REPO

PROBE_SNIPPET = r"""
import json, time, torch
measure = MEASURE
info = {"cuda": torch.cuda.is_available(), "count": torch.cuda.device_count() if torch.cuda.is_available() else 0}
if info["cuda"]:
    info["names"] = [torch.cuda.get_device_name(i) for i in range(info["count"])]
    info["memory_gib"] = [round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1) for i in range(info["count"])]
if measure:
    if info["cuda"]:
        n, dtype, device = 8192, torch.bfloat16, "cuda"
    else:
        n, dtype, device = 1024, torch.float32, "cpu"
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    best = 0.0
    for repeat in range(4):
        iterations = 50 if info["cuda"] else 5
        if info["cuda"]:
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(iterations):
            c = a @ b
        if info["cuda"]:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        if repeat:  # the first round warms up
            best = max(best, 2 * n**3 * iterations / elapsed)
    info["measured_tflops"] = best / 1e12
    info["measured_with"] = f"{n}x{n} {str(dtype).replace('torch.', '')} matmul on {device}"
print("PROBE " + json.dumps(info))
"""


def probe_devices(measure: bool, env: dict) -> dict:
    code = PROBE_SNIPPET.replace("MEASURE", "True" if measure else "False")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    for line in done.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[len("PROBE "):])
    raise RuntimeError(f"the device probe failed:\n{done.stdout}\n{done.stderr}")


def nvml_indices(count: int) -> list[str]:
    """NVML ids (indices or UUIDs) of the GPUs the launches see (CUDA_VISIBLE_DEVICES, else all)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip() == "":
        return [str(i) for i in range(count)]
    return [item.strip() for item in visible.split(",") if item.strip()][:count]


@dataclass(frozen=True)
class Devices:
    """How many devices a run uses, their name, the peak per device (and where it comes from), the GPUs to sample."""
    count: int
    label: str  # "4x NVIDIA H100 80GB HBM3", "2 CPU processes"
    folder_slug: str  # in the results folder's name
    peak_tflops: float
    peak_source: str
    sampler_ids: list  # NVML ids of the GPUs to sample; none on CPU


SMOKE_PEAK_SOURCE = ("nominal CPU figure per process (one core: 2 AVX2 FMA units x 8 fp32 lanes x 2 FLOP x ~3 GHz), "
                     "not a measurement")


def choose_devices(probe: dict, env: dict, *, smoke: bool, gpus: int | None, peak_tflops: float | None,
                   dry_run: bool) -> Devices:
    """Smoke: 2 CPU processes at the nominal peak. Otherwise all visible GPUs or the first `gpus` of them
    (CUDA_VISIBLE_DEVICES narrowed in `env` and in this process). Exits with an error when there are none."""
    if smoke:
        return Devices(2, "2 CPU processes", "cpu-smoke", peak_tflops or CPU_NOMINAL_PEAK_TFLOPS,
                       "--peak-tflops" if peak_tflops else SMOKE_PEAK_SOURCE, [])
    visible = probe["count"]
    if visible == 0 and not dry_run:
        sys.exit("error: no GPU visible; use --smoke for the CPU path")
    devices = gpus or visible
    if devices == 0:
        sys.exit("error: no GPU visible; give --gpus N to print the commands of an N-GPU box")
    if visible and devices > visible:
        sys.exit(f"error: --gpus {devices} but only {visible} GPU(s) are visible")
    if visible and devices < visible:
        ids = nvml_indices(visible)[:devices]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        os.environ["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
    name = (probe.get("names") or ["unknown GPU"])[0]
    peak, peak_source = gpu_peak(name, probe, peak_tflops, dry_run)
    return Devices(devices, f"{devices}x {name}", f"{devices}x-{slug(name.replace('NVIDIA ', ''))}", peak, peak_source,
                   nvml_indices(devices))


def gpu_peak(name: str, probe: dict, peak_tflops: float | None, dry_run: bool) -> tuple[float, str]:
    """(dense bf16 TFLOP/s per GPU, its source): --peak-tflops, else the table, else the measurement."""
    found = table_peak(name)
    measured = probe.get("measured_tflops")
    if peak_tflops:
        return peak_tflops, "--peak-tflops"
    if found:
        return found[0], f"table: {found[1]} dense bf16"
    if measured:
        return measured, f"measured ({probe.get('measured_with')}): {name} is not in the table"
    if dry_run:
        return 1.0, "dry run"
    sys.exit(f"error: {name!r} is not in the peak table; give --peak-tflops (dense bf16 TFLOP/s per GPU) "
             "or --measure-peak")
