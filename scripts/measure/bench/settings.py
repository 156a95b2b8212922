"""From the flags of scripts/measure/benchmark.py to what is run: the workload, its strategies, and the settings every
launch shares (model, data, folders, batch, layers, peak)."""

from __future__ import annotations

import datetime
import shlex
import sys
from pathlib import Path

from bench.devices import Devices
from bench.formatting import slug
from bench.paths import TINY_CONFIG
from bench.random_model import ensure_model
from bench.shapes import shape_of
from bench.workloads import STRATEGIES, WORKLOADS, Workload


def choose_workload(smoke: bool, workload: str, strategies: str | None) -> tuple[Workload, list[str]]:
    """The workload (smoke, or --workload) and the names of its strategies (--strategies, else its own set)."""
    chosen = WORKLOADS["smoke" if smoke else workload]
    names = [s.strip() for s in (strategies or ",".join(chosen.strategies)).split(",") if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or not names:
        sys.exit(f"error: unknown strategies {unknown or names}; choose among {', '.join(STRATEGIES)}")
    return chosen, names


def results_folder(output_root: Path, date: str, device_slug: str, versions: dict) -> Path:
    """<output-dir>/<YYYY-MM-DD>_<device>_torch<ver>_transformers<ver>/"""
    return output_root / (f"{date}_{device_slug}_torch{slug(versions.get('torch', '?'))}"
                          f"_transformers{slug(versions.get('transformers', '?'))}")


def run_settings(args, workload: Workload, devices: Devices, versions: dict) -> dict:
    """What every launch of the run shares, from the parsed flags; builds the model when it is absent
    (not on --dry-run). Exits with an error on a bad --layers."""
    output_root = Path(args.output_dir).resolve()
    cache = Path(args.model_cache).resolve() if args.model_cache else output_root / "models"
    full_layers = shape_of(workload.config or TINY_CONFIG).layers
    layers = args.layers or full_layers
    if args.smoke and args.layers:
        sys.exit("error: --layers applies to the GPU workloads, not to --smoke")
    if not 1 <= layers <= full_layers:
        sys.exit(f"error: --layers must be between 1 and {full_layers}")
    date = datetime.date.today().isoformat()
    folder = results_folder(output_root, date, devices.folder_slug, versions)
    model = ensure_model(workload, layers, cache, dry_run=args.dry_run)
    data = output_root / "data" / f"text-{workload.rows}x{workload.max_length}"
    shape = shape_of(model / "config.json") if (model / "config.json").exists() else shape_of(
        workload.config or TINY_CONFIG, layers)
    return {"workload": workload, "model": model, "data": data, "runs": folder / "runs", "devices": devices.count,
            "device_label": devices.label, "smoke": args.smoke, "batch_size": args.batch_size or workload.batch_size,
            "grad_accum": args.grad_accum or workload.grad_accum, "gradient_checkpointing": args.gradient_checkpointing,
            "timeout": args.timeout, "shape": shape, "layers": layers, "full_layers": full_layers,
            "peak_tflops": devices.peak_tflops, "recipe_args": tuple(shlex.split(args.recipe_args)),
            "date": date, "folder": folder}
