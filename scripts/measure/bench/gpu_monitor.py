"""GPU utilisation (NVML) and the training window, sampled while a launch runs."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path


class GpuSampler:
    """Reads each visible GPU's utilisation (%) and memory in use, via pynvml, else nvidia-smi."""

    def __init__(self, ids: list[str]):
        self.ids = ids
        self.kind = None
        self.handles = []
        if not ids:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            for gpu in ids:
                if gpu.isdigit():
                    self.handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(gpu)))
                else:
                    self.handles.append(pynvml.nvmlDeviceGetHandleByUUID(gpu))
            self.nvml = pynvml
            self.kind = "pynvml"
            return
        except Exception:  # not installed, no driver, MIG ids, ...
            self.handles = []
        if shutil.which("nvidia-smi") and self._smi() is not None:
            self.kind = "nvidia-smi"

    def _smi(self):
        try:
            done = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                                   "--format=csv,noheader,nounits", "-i", ",".join(self.ids)],
                                  capture_output=True, text=True, timeout=5)
            rows = [line.split(",") for line in done.stdout.strip().splitlines()]
            return [(float(util), float(used) / 1024) for util, used in rows]
        except Exception:
            return None

    def sample(self):
        """[(util %, used GiB)] per GPU, or None."""
        if self.kind == "pynvml":
            try:
                return [(float(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu),
                         self.nvml.nvmlDeviceGetMemoryInfo(h).used / 2**30) for h in self.handles]
            except Exception:
                return None
        if self.kind == "nvidia-smi":
            return self._smi()
        return None


class LaunchMonitor(threading.Thread):
    """Every `interval` s: one GPU sample, and the time each new training step appears in metrics.jsonl."""

    def __init__(self, sampler: GpuSampler | None, metrics_path: Path, interval: float = 0.5):
        super().__init__(daemon=True)
        self.sampler, self.metrics_path, self.interval = sampler, metrics_path, interval
        self.samples = []  # (time, [(util, used GiB)])
        self.step_seen = {}  # step -> time its line was first read
        self.stopped = threading.Event()
        self._offset = 0
        self._partial = ""

    def _read_steps(self, now: float) -> None:
        try:
            with open(self.metrics_path) as file:
                file.seek(self._offset)
                chunk = file.read()
                self._offset = file.tell()
        except OSError:
            return
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("type") == "train":
                self.step_seen.setdefault(record["step"], now)

    def run(self) -> None:
        while not self.stopped.is_set():
            now = time.monotonic()
            if self.sampler is not None and self.sampler.kind:
                values = self.sampler.sample()
                if values:
                    self.samples.append((now, values))
            self._read_steps(now)
            self.stopped.wait(self.interval)
        self._read_steps(time.monotonic())

    def stop(self) -> None:
        self.stopped.set()
        self.join()

    def training_utilisation(self, wall_s: float) -> dict:
        """Mean GPU utilisation over the training steps: from the first step's line to the last's (both
        as seen here, +-0.5 s), i.e. the steady steps; with a single step, the wall time before it."""
        if not self.samples:
            return {"gpu_util": None, "gpu_util_per_gpu": None, "gpu_used_gib_max": None, "util_samples": 0}
        seen = sorted(self.step_seen.values())
        if len(seen) >= 2 and seen[-1] - seen[0] >= self.interval:
            start, end = seen[0], seen[-1]
        elif seen:
            start, end = seen[-1] - wall_s, seen[-1]
        else:
            start, end = self.samples[0][0], self.samples[-1][0]
        window = [values for at, values in self.samples if start <= at <= end] or [self.samples[-1][1]]
        per_gpu = [statistics.fmean(values[i][0] for values in window) / 100 for i in range(len(window[0]))]
        used = max(value[1] for _, values in self.samples for value in values)
        return {"gpu_util": statistics.fmean(per_gpu), "gpu_util_per_gpu": [round(u, 3) for u in per_gpu],
                "gpu_used_gib_max": round(used, 2), "util_samples": len(window)}

