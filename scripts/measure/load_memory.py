"""Host RAM at load, per rank, under each sharded config against DDP's replica, through the real launcher.

    python scripts/measure/load_memory.py --build /tmp/llama-0.8b --out results/<date>_cpu_load-memory
    python scripts/measure/load_memory.py --model PATH --out DIR [--launches ddp:2 fsdp:2 full/tp:2 qlora/fsdp:2 ...]

A launch is [RECIPE/]CONFIG:PROCESSES (RECIPE: lora, the default, full or qlora). Each runs the recipe up to the end of its first optimizer step (a micro-batch of one 64-token
row, fp32 on CPU processes), then is stopped. Each rank's peak resident memory from its start to the
recipe's start-up line (the model loaded and prepared) is run.json's `host_peak_at_start_gib_by_rank`; the
peak with the first step too (`host_peak_gib_by_rank`) is kept beside it. The seconds are from the launch to
that start-up line (reading, loading, preparing).
`fsdp-every-rank` is fsdp.yaml with fsdp_cpu_ram_efficient_loading off: every process reads the whole
model; it runs beside `fsdp` (each process reads its shards from the files) in the same call. --build writes a random Llama of about 0.78B parameters (bfloat16 safetensors, the bundled
tokenizer) first.
Writes results.json and results.md to --out; run it under ../shared/tools/capped where memory is short.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "measure"))
from pipeline_loading import built_with_tokenizer, short_rows  # noqa: E402  (the same random Llama)

CONFIGS = {"ddp": "ddp.yaml", "fsdp": "fsdp.yaml", "fsdp_grad_op": "fsdp_grad_op.yaml",
           "fsdp_offload": "fsdp_offload.yaml", "zero3": "zero3.yaml", "zero3_offload": "zero3_offload.yaml",
           "fsdp-every-rank": "fsdp.yaml", "tp": "tp.yaml"}
DEFAULT_LAUNCHES = ["ddp:2", "fsdp-every-rank:2", "fsdp:2", "fsdp_grad_op:2", "fsdp_offload:2", "zero3:2",
                    "zero3_offload:2", "full/tp:2", "qlora/ddp:2", "qlora/fsdp:2", "qlora/zero3:2", "fsdp:4", "zero3:4"]
# tensor parallel splits these layers along their output: LoRA on them needs no gathering (tests/test_tensor_parallel.py)
COLUMN_SPLIT = "q_proj,k_proj,v_proj,gate_proj,up_proj"


def config_file(name: str, folder: Path) -> Path:
    path = REPO / "accelerate_configs" / CONFIGS[name]
    if name != "fsdp-every-rank":
        return path
    copy = folder / "fsdp_every_rank.yaml"
    copy.write_text(path.read_text().replace("fsdp_cpu_ram_efficient_loading: true",
                                             "fsdp_cpu_ram_efficient_loading: false"))
    return copy


def recorded(path: Path) -> dict:
    """run.json as written so far ({} while it is missing or half written)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def stop(process: subprocess.Popen, output: Path) -> None:
    """SIGKILL to the launcher and to every rank it started (the ranks run in sessions of their own, so they
    are found by their --output-dir); not SIGTERM, on which the recipe would save a checkpoint first."""
    for pid in [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]:
        try:
            if str(output) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
    process.wait()


def launch(spec: str, model: str, dataset: Path, folder: Path, index: int) -> dict:
    """One launch, `[RECIPE/]CONFIG:PROCESSES`, up to its first step's run.json (`index`: its place in the
    list, which may name a launch twice to time it again)."""
    recipe, _, rest = spec.rpartition("/")
    recipe = recipe or "lora"
    name, processes = rest.split(":")
    tensor_parallel = ["--parallelism_config_tp_size", processes] if name == "tp" else []
    output = folder / f"{index}-{recipe}-{name}-{processes}"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file(name, folder)),
               "--num_processes", processes, *tensor_parallel, "--mixed_precision", "no",
               str(REPO / "recipes" / f"{recipe}.py"),
               "--model", model, "--dataset", str(dataset), "--output-dir", str(output), "--max-steps", "1",
               "--batch-size", "1", "--max-length", "64", "--log-every", "1", "--report-to", "none"]
    if name == "tp" and recipe != "full":
        command += ["--lora-targets", COLUMN_SPLIT]
    began = time.perf_counter()
    log = folder / f"{index}-{recipe}-{name}-{processes}.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    started = None
    while True:  # until run.json holds each rank's peak (after the first step): the rest of the run is not measured
        time.sleep(0.25)
        text = log.read_text()
        if started is None and any(line.startswith(f"{recipe}: ") for line in text.splitlines()):
            started = time.perf_counter() - began
        ran = recorded(output / "run.json")
        if process.poll() is not None or "host_peak_gib_by_rank" in ran:
            break
    stop(process, output)
    if "host_peak_gib_by_rank" not in ran:
        raise SystemExit(f"{spec} failed:\n{text[-3000:]}")
    return {"launch": name, "recipe": recipe, "processes": int(processes), "load_peak_gib_by_rank": ran["host_peak_at_start_gib_by_rank"],
            "with_first_step_gib_by_rank": ran["host_peak_gib_by_rank"],
            "seconds_to_start": round(started, 1), "loading": ran["launch"].get("loading"),
            "distributed_type": ran["distributed_type"]}


def table(rows: list[dict]) -> str:
    ddp = next((row for row in rows if (row["recipe"], row["launch"]) == ("lora", "ddp")), None)
    replica = max(ddp["load_peak_gib_by_rank"]) if ddp else None  # without a lora/ddp launch: no ratios

    def share(gib: float) -> str:
        return f"{gib / replica:.0%}" if replica else "(no ddp launch)"

    lines = ["| recipe | launch | processes | peak host RAM per rank at load (GiB) | largest / DDP replica | others / DDP replica "
             "| seconds to start |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        peaks = row["load_peak_gib_by_rank"]
        largest, others = max(peaks), sorted(peaks)[:-1]
        lines.append(f"| {row['recipe']} | {row['launch']} | {row['processes']} | {' / '.join(f'{p:.2f}' for p in peaks)} | "
                     f"{share(largest)} | {share(max(others, default=largest))} | {row['seconds_to_start']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a local model folder")
    parser.add_argument("--build", type=Path, default=None, help="write a random ~0.78B Llama here first")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--launches", nargs="+", default=DEFAULT_LAUNCHES, help="[RECIPE/]CONFIG:PROCESSES (lora on ddp first: the replica the others are held against)")
    args = parser.parse_args(argv)
    if args.build:
        args.model = built_with_tokenizer(args.build)
    if not args.model:
        parser.error("give --model or --build")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        dataset = short_rows(folder)
        for index, spec in enumerate(args.launches):
            rows.append(launch(spec, args.model, dataset, folder, index))
            print(json.dumps(rows[-1]), flush=True)
            # after each launch: a later one that fails keeps the ones before
            (args.out / "results.json").write_text(json.dumps({"model": args.model, "launches": rows}, indent=2) + "\n")
    (args.out / "results.md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
