"""A checkpoint's save time, and its resume as written against its resume under another launch (read by name).

    python scripts/measure/resume_time.py --build /tmp/llama-0.8b --out results/<date>_cpu_resume-time
    python scripts/measure/resume_time.py --model PATH --out DIR [--cases full:fsdp:2:zero3:2 ...]

A case is RECIPE:WRITTEN:PROCESSES:RESUMED:PROCESSES. The recipe runs one optimizer step under the WRITTEN
config (a micro-batch of one 64-token row, fp32 on CPU processes) and saves its checkpoint (the state file's
`save_seconds`: from the save's start to the state file); then it resumes from it for a second step, once
under the same launch (read as written) and once under the RESUMED one (read by parameter name). The read
seconds are the recipe's own `resumed from ... (read ... in S s)` line; the peak resident memory per rank is
run.json's `host_peak_gib_by_rank`; the bytes each rank fetched from storage while it read the checkpoint are its
/proc/self/io `read_bytes` around `resume_from` (a hook on the launch's PYTHONPATH), with the page cache
dropped before each resume where this user may (root), so that they are real reads; otherwise they are left
out. --build writes a random Llama of about 0.78B parameters (bfloat16 safetensors, the bundled tokenizer)
first. Writes results.json and results.md to --out; run it under ../shared/tools/capped where memory is short.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "measure"))
from pipeline_loading import built_with_tokenizer, short_rows  # noqa: E402  (the same random Llama)

DEFAULT_CASES = ["full:fsdp:2:tp:2", "lora:zero3:2:fsdp:2"]
# Each rank's storage reads while it reads the checkpoint: resume_from wrapped, one file per rank.
READS_HOOK = """
import json, os, sys
from pathlib import Path
if os.environ.get("RESUME_READS_DIR"):
    sys.path.insert(0, os.environ["RESUME_RECIPES"])
    from common.outputs import checkpoint

    def fetched():
        return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["read_bytes"])

    def resume_from(*args, _resume_from=checkpoint.resume_from, **kwargs):
        before = fetched()
        step = _resume_from(*args, **kwargs)
        file = Path(os.environ["RESUME_READS_DIR"]) / f"rank-{os.environ.get('RANK', '0')}.json"
        file.write_text(json.dumps({"read_bytes": fetched() - before}))
        return step

    checkpoint.resume_from = resume_from
"""


def drop_page_cache() -> bool:
    """Empty the kernel's page cache (root only), so the next launch's reads come from storage."""
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False
READ = re.compile(r"resumed from \S+ at step \d+ \(read (as written|by parameter name) in ([0-9.]+) s\)")


def run(recipe: str, config: str, processes: int, model: str, dataset: Path, output: Path, steps: int) -> dict:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "accelerate_configs" / f"{config}.yaml"), "--num_processes", str(processes),
               *(["--parallelism_config_tp_size", str(processes)] if config == "tp" else []), "--mixed_precision", "no", str(REPO / "recipes" / f"{recipe}.py"), "--model", model,
               "--dataset", str(dataset), "--output-dir", str(output), "--max-steps", str(steps), "--save-every", "1",
               "--batch-size", "1", "--max-length", "64", "--log-every", "1", "--report-to", "none"]
    env, reads = dict(os.environ), None
    if steps > 1:
        command += ["--resume", str(output / "checkpoints" / "step-1")]
        reads = output.parent / f"{output.name}-reads"
        (reads / "hook").mkdir(parents=True, exist_ok=True)
        (reads / "hook" / "sitecustomize.py").write_text(READS_HOOK)
        env.update(RESUME_READS_DIR=str(reads), RESUME_RECIPES=str(REPO / "recipes"),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(reads / "hook"), env.get("PYTHONPATH")])))
        cold = drop_page_cache()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    ran = json.loads((output / "run.json").read_text())
    found = READ.search(done.stdout + done.stderr)
    state = json.loads((output / "checkpoints" / "step-1" / "recipe_state.json").read_text())
    fetched = None
    if reads is not None and cold:
        fetched = [round(json.loads((reads / f"rank-{rank}.json").read_text())["read_bytes"] / 1e9, 2)
                   for rank in range(processes)]
    return {"launch": f"{config}:{processes}", "peak_gib_by_rank": ran.get("host_peak_gib_by_rank"),
            "save_seconds": state["save_seconds"], "read": found and found.group(1),
            "read_seconds": found and float(found.group(2)), "read_from_storage_gb_by_rank": fetched,
            "checkpoint_gb": round(sum(f.stat().st_size for f in (output / "checkpoints" / "step-1").rglob("*")
                                       if f.is_file()) / 1e9, 2)}


def measure(case: str, model: str, dataset: Path, folder: Path) -> dict:
    recipe, written, written_processes, resumed, resumed_processes = case.split(":")
    first = folder / "first"
    shutil.rmtree(first, ignore_errors=True)
    saved = run(recipe, written, int(written_processes), model, dataset, first, 1)
    results = {"case": case, "recipe": recipe, "written": saved}
    for name, config, processes in (("as_written", written, written_processes), ("by_name", resumed, resumed_processes)):
        again = folder / name
        shutil.rmtree(again, ignore_errors=True)
        shutil.copytree(first / "checkpoints" / "step-1", again / "checkpoints" / "step-1")
        results[name] = run(recipe, config, int(processes), model, dataset, again, 2)
        shutil.rmtree(again, ignore_errors=True)
    shutil.rmtree(first, ignore_errors=True)
    return results


def table(rows: list[dict]) -> str:
    lines = ["| recipe | written under | checkpoint GB | save s | resumed as written | read s | GB from storage per rank | "
             "resumed under | read by name s | GB from storage per rank | peak GiB per rank (by name) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def each(values, digits=2):
        return " / ".join(f"{value:.{digits}f}" for value in values) if values else "-"

    for row in rows:
        written, same, other = row["written"], row["as_written"], row["by_name"]
        lines.append(f"| {row['recipe']} | {written['launch']} | {written['checkpoint_gb']} | {written['save_seconds']} | "
                     f"{same['launch']} | {same['read_seconds']} | {each(same['read_from_storage_gb_by_rank'])} | "
                     f"{other['launch']} | {other['read_seconds']} | {each(other['read_from_storage_gb_by_rank'])} | "
                     f"{each(other['peak_gib_by_rank'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local model folder (safetensors)")
    parser.add_argument("--build", help="write a random Llama here first, and measure it")
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
    args = parser.parse_args()
    model = built_with_tokenizer(Path(args.build)) if args.build else args.model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        dataset = short_rows(folder)
        for case in args.cases:
            rows.append(measure(case, model, dataset, folder))
            print(json.dumps(rows[-1]), flush=True)
            (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
            (out / "results.md").write_text(table(rows))


if __name__ == "__main__":
    main()
