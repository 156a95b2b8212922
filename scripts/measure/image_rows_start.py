#!/usr/bin/env python
"""What images cost before the first step: a launch on N chat rows with an image each, beside the same rows
without their images, on the same tiny vision-language model (Qwen2-VL's architecture, built offline).

    python scripts/measure/image_rows_start.py --rows 100000 10000 --output-dir outputs/image-rows-start

For each row count and each kind of rows (`images`: the bundled vision task's rows repeated, each listing its
56x56 PNG by absolute path; `text`: the same rows with the image's part and the `images` column left out), one
recipes/lora.py launch under ddp.yaml on 2 processes, one step of 8 rows a process: from the launch to its end with a
cold data cache (a fresh HF_DATASETS_CACHE: every row read, checked and tokenised; for image rows every image's
header read), then again with that cache warm. Recorded: the seconds, each rank's peak resident memory (run.json),
the `data:` line. Writes --output-dir/summary.json and README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VISION = REPO / "data" / "vision"
MODEL = REPO / "models" / "tiny-qwen2-vl"


def write_rows(path: Path, count: int, images: bool) -> None:
    """`count` rows of the bundled vision task, repeated in order; without `images`, text only."""
    source = [json.loads(line) for line in (VISION / "train.jsonl").read_text().splitlines()]
    with open(path, "w") as file:
        for i in range(count):
            row = json.loads(json.dumps(source[i % len(source)]))
            if images:
                row["images"] = [str((VISION / name).resolve()) for name in row["images"]]
            else:
                del row["images"]
                row["messages"][0]["content"] = [part for part in row["messages"][0]["content"] if part["type"] == "text"]
            file.write(json.dumps(row) + "\n")


def launch(data: Path, output: Path, cache: Path) -> dict:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml",
               "--num_processes", "2", "--mixed_precision", "no", "recipes/lora.py", "--model", str(MODEL),
               "--dataset", str(data), "--max-steps", "1", "--batch-size", "8", "--output-dir", str(output)]
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_DATASETS_CACHE": str(cache)})
    seconds = round(time.monotonic() - started, 1)
    if done.returncode != 0:
        raise SystemExit((done.stdout + done.stderr)[-3000:])
    run = json.loads((output / "run.json").read_text())
    data_line = next(line for line in done.stdout.splitlines() if line.startswith("data ("))
    return {"seconds": seconds, "host_peak_gib_by_rank": run["host_peak_gib_by_rank"], "data_line": data_line}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 10_000])
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/image-rows-start"))
    args = parser.parse_args(argv)
    out = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not (MODEL / "config.json").is_file():
        subprocess.run([sys.executable, "scripts/build_tiny_model.py", "--family", "qwen2-vl"], cwd=REPO, check=True)
    results = []
    for rows in args.rows:
        for kind in ("images", "text"):
            data = out / f"{kind}-{rows}.jsonl"
            write_rows(data, rows, kind == "images")
            cache = out / f"cache-{kind}-{rows}"
            cold = launch(data, out / f"run-{kind}-{rows}-cold", cache)
            warm = launch(data, out / f"run-{kind}-{rows}-warm", cache)
            results.append({"rows": rows, "kind": kind, "cold": cold, "warm": warm})
            print(json.dumps(results[-1]), flush=True)
    summary = {"command": "python scripts/measure/image_rows_start.py --rows " + " ".join(map(str, args.rows)),
               "machine": f"{os.cpu_count()} CPUs", "results": results}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = ["| rows | rows hold | launch to end, cold cache | warm cache | peak RSS per rank (cold) |", "|---|---|---|---|---|"]
    for result in results:
        peaks = " / ".join(f"{gib:.2f}" for gib in result["cold"]["host_peak_gib_by_rank"])
        lines.append(f"| {result['rows']:,} | {result['kind']} | {result['cold']['seconds']} s | "
                     f"{result['warm']['seconds']} s | {peaks} GiB |")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
