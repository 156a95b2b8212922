"""The run's environment: the launches' environment variables, the library versions, results.json's record."""

from __future__ import annotations

import os
import sys

from bench.devices import Devices


def launch_environment(smoke: bool) -> dict:
    """Offline, unbuffered launches; the smoke run hides the GPUs (the CPU path, also on a GPU box)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a GPU box
    return env


def library_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "accelerate", "peft", "deepspeed", "bitsandbytes", "datasets"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def environment_record(date: str, devices: Devices, probe: dict, versions: dict, smoke: bool) -> dict:
    """results.json's `environment`: the date, the devices and their peak, the library versions."""
    return {"date": date, "device_label": devices.label, "devices": devices.count, "probe": probe,
            "peak_tflops": devices.peak_tflops, "peak_source": devices.peak_source,
            "measured_tflops": probe.get("measured_tflops"), "measured_with": probe.get("measured_with"),
            "versions": versions, "smoke": smoke, "python": sys.version.split()[0]}
