#!/usr/bin/env python
"""The GPU proof in one command: installs what the GPU box lacks, then runs on its GPUs, in order
of importance, and writes each result as soon as it has it.

    python scripts/gpu_check.py --wheels .whl --results $OUT     # everything (about 25 min on one H100)
    python scripts/gpu_check.py --parts recipes --results $OUT   # one part (each fits a 10-minute slot)

Parts:
  recipes    tests/gpu/test_gpu_recipes.py: every recipe x every config the GPUs present can run, bf16
  planner    tests/gpu/test_gpu_planner.py: the planner's peak against torch.cuda.max_memory_allocated
  options    tests/gpu/test_gpu_speed_options.py: bitsandbytes CUDA, Liger, attention kernels, compile, workers,
             --batch-size auto's probe
  reference  scripts/benchmark.py --workload tinyllama --measure-peak (the TinyLlama-1.1B LoRA workload)
  reference34b  the CodeLlama-34B LoRA workload, layer-scaled to 8 of 48 layers
  trl        scripts/compare_trl.py on one GPU in bf16: the recipe against TRL's SFTTrainer

Written to --results (default results/<date>_<gpu>/), rewritten after every part, so that a run cut
short still leaves its numbers: summary.md (tables), results.json (the same, machine-readable, with
every test case's recorded figures), log.txt (every command and its output) and the reference
benchmark's reference.md, reference.json and chart.png: 6 files in one folder, within what the
device tool brings back (8 files).

Wheels (--wheels DIR): a folder of wheels made on a connected machine by scripts/gpu_wheels.sh,
installed with `pip --no-index` into /tmp/gpu-site (added to PYTHONPATH for every launch); a
DeepSpeed source archive there is built without its ops (DS_BUILD_OPS=0).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SITE = Path("/tmp/gpu-site")
PARTS = {  # part -> (command, seconds it may take)
    "recipes": (["-m", "pytest", "-q", "-o", "junit_family=legacy", "tests/gpu/test_gpu_recipes.py"], 540),
    "planner": (["-m", "pytest", "-q", "-o", "junit_family=legacy", "tests/gpu/test_gpu_planner.py"], 420),
    "options": (["-m", "pytest", "-q", "-o", "junit_family=legacy", "tests/gpu/test_gpu_speed_options.py"], 360),
    "reference": (["scripts/benchmark.py", "--workload", "tinyllama", "--measure-peak"], 540),
    # CodeLlama-34B's shape cut to 8 of its 48 layers (labelled so in the table): the whole does not fit one GPU
    "reference34b": (["scripts/benchmark.py", "--workload", "codellama34b", "--layers", "8",
                      "--gradient-checkpointing", "--measure-peak"], 540),
    # the TinyLlama workload's model, micro-batch and accumulation through TRL's SFTTrainer beside the recipe
    # (the bundled instruction data: TRL's side needs prompt/completion rows), bf16, one GPU
    "trl": (["scripts/compare_trl.py", "--processes", "1", "--mixed-precision", "bf16", "--model",
             "models/tinyllama-1.1b-22-layers", "--batch-size", "16", "--grad-accum", "2", "--max-length", "1024",
             "--steps", "40", "--rounds", "1"], 420),
}
# the random-weight TinyLlama-1.1B-shaped model of tests/gpu (built once, also by the planner part)
BUILD_MODEL = ["-c", "import sys; sys.path.insert(0, 'tests/gpu'); from gpu_support import shaped_model; "
                     "shaped_model(layers=22)"]


def parse_args(argv=None):
    summary, _, details = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, among {', '.join(PARTS)}")
    parser.add_argument("--wheels", type=Path, default=None, help="a folder of wheels to install first")
    parser.add_argument("--results", type=Path, default=None, help="where to write (default: results/<date>_<gpu>)")
    args = parser.parse_args(argv)
    unknown = [part for part in args.parts.split(",") if part not in PARTS]
    if unknown:
        parser.error(f"unknown part {', '.join(unknown)}; choose among {', '.join(PARTS)}")
    return args


def install_wheels(folder: Path, log) -> dict:
    """pip --no-index from `folder` into SITE; DeepSpeed from its source archive without ops."""
    SITE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    archives = sorted(str(p) for p in folder.glob("deepspeed-*.tar.gz"))
    commands = []
    if wheels:
        commands.append([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                         "--upgrade", "--target", str(SITE), *wheels])
    for archive in archives:
        commands.append([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                         "--no-build-isolation", "--target", str(SITE), archive])
    codes = [run(command, log, timeout=600, env={"DS_BUILD_OPS": "0"})["returncode"] for command in commands]
    return {"wheels": [Path(w).name for w in wheels + archives], "returncodes": codes}


def environment() -> dict:
    code = ("import json, torch; p = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None; "
            "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
            "'gpus': torch.cuda.device_count(), 'gpu': p.name if p else None, "
            "'gpu_memory_gib': round(p.total_memory / 2**30, 1) if p else None}))")
    found = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      env=launch_env(), check=True).stdout)
    from importlib.metadata import PackageNotFoundError, version

    for name in ("transformers", "accelerate", "peft", "datasets", "bitsandbytes", "deepspeed", "trl",
                 "liger-kernel", "flash-attn"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def launch_env(extra: dict | None = None) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(extra or {})}
    if SITE.exists():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), env.get("PYTHONPATH")]))
    return env


def run(command: list[str], log, timeout: int, env: dict | None = None) -> dict:
    """Run `command` in the repository, its output into the log; never raises."""
    started = time.monotonic()
    log.write(f"\n$ {' '.join(command)}\n")
    log.flush()
    try:
        done = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                              env=launch_env(env))
        code = done.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    return {"returncode": code, "seconds": round(time.monotonic() - started, 1)}


def junit_cases(path: Path) -> list[dict]:
    """Each test case of a junit XML: name, outcome, seconds and its recorded properties."""
    if not path.exists():
        return []
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = f"{tag}: {(element.get('message') or '').splitlines()[0][:160] if element.get('message') else ''}"
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        cases.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0)),
                      **properties})
    return cases


def summary_markdown(record: dict) -> str:
    env = record["environment"]
    lines = [f"# GPU check, {record['date']}: {env.get('gpu')} x {env.get('gpus')}", "",
             f"`python scripts/gpu_check.py --parts {record['parts']}` at commit {record['commit']}.", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("gpu", "gpus") and v), ""]
    for part, result in record["results"].items():
        lines += [f"## {part}", "", f"exit {result['returncode']} after {result['seconds']} s", ""]
        cases = result.get("cases", [])
        if cases:
            keys = sorted({k for c in cases for k in c} - {"name", "outcome", "seconds"})
            columns = ["case", "outcome", "s", *keys]
            lines += ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
            lines += ["| " + " | ".join([c["name"], c["outcome"], f"{c['seconds']:.0f}",
                                         *(str(c.get(k, "")) for k in keys)]) + " |" for c in cases]
            lines.append("")
        if result.get("table"):
            lines += [result["table"], ""]
        if result.get("summary"):
            summary = result["summary"]
            lines += [f"median target tokens/s: {summary.get('median_tokens_per_s')}; ratio (ours / TRL): "
                      f"{summary.get('ratio')}", ""]
    return "\n".join(lines) + "\n"


def copy_reference(folder: Path, results_dir: Path, result: dict) -> None:
    """benchmark.py's table, numbers and chart (its newest results folder) beside the summary."""
    tables = sorted(folder.rglob("results.md"), key=lambda p: p.stat().st_mtime)
    if not tables:
        return
    source = tables[-1].parent
    result["table"] = tables[-1].read_text()
    for name, target in (("results.md", "reference.md"), ("results.json", "reference.json"),
                         ("chart.png", "chart.png")):
        if (source / name).exists():
            (results_dir / target).write_bytes((source / name).read_bytes())


def git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main(argv=None) -> int:
    args = parse_args(argv)
    parts = args.parts.split(",")
    date = datetime.date.today().isoformat()
    results_dir = args.results
    results_dir_default = results_dir is None
    record = {"date": date, "parts": args.parts, "commit": git_commit(), "results": {}}
    temporary = Path("/tmp/gpu-check-log.txt")
    with open(temporary, "a") as log:
        if args.wheels:
            record["install"] = install_wheels(args.wheels, log)
        record["environment"] = environment()
        if results_dir_default:
            gpu = (record["environment"].get("gpu") or "no-gpu").replace(" ", "-")
            results_dir = REPO / "results" / f"{date}_{gpu}"
        results_dir.mkdir(parents=True, exist_ok=True)

        def save() -> None:
            (results_dir / "results.json").write_text(json.dumps(record, indent=2) + "\n")
            (results_dir / "summary.md").write_text(summary_markdown(record))
            log.flush()
            (results_dir / "log.txt").write_text(temporary.read_text())

        save()
        scratch = Path("/tmp/gpu-check")
        scratch.mkdir(parents=True, exist_ok=True)
        for part in parts:
            command, timeout = PARTS[part]
            command = [sys.executable, *command]
            junit = scratch / f"junit-{part}.xml"
            if part.startswith("reference"):
                command += ["--output-dir", str(scratch / "reference")]
            elif part == "trl":
                run([sys.executable, *BUILD_MODEL], log, timeout=600)
                command += ["--output-dir", str(scratch / "trl")]
            else:
                command += [f"--junitxml={junit}"]
            result = run(command, log, timeout=timeout)
            if part == "trl" and (scratch / "trl" / "summary.json").exists():
                result["summary"] = json.loads((scratch / "trl" / "summary.json").read_text())
            result["cases"] = junit_cases(junit)
            if part.startswith("reference"):
                copy_reference(scratch / "reference", results_dir, result)
            record["results"][part] = result
            save()
            print(f"{part}: exit {result['returncode']} after {result['seconds']} s", flush=True)
    print(f"results in {results_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
