#!/usr/bin/env python
"""Preference tuning at users' sizes: what preparing N pairs costs, through the real launcher.

    python scripts/measure/preference_speed.py --pairs 100000 --out results/<date>_cpu_preference-100k
    python scripts/measure/preference_speed.py --pairs 200                      # the test's run
    python scripts/measure/preference_speed.py --recipe kto --no-full --pairs 100000 --out results/<date>_cpu_kto-100k

Pairs: UltraFeedback's layout (whole `chosen` / `rejected` conversations sharing their opening turns: the
implicit prompt), of scripts/measure/prepare_speed.py's sentences (1-2 exchanges, replies of 1-4 sentences, about
half with a system prompt); the rejected side's last reply is another one. The bundled tiny model and
tokenizer (the recipes' default chat template), `ddp.yaml`, 2 processes, `--max-length 1024`, one
optimizer step, each launch with the same fresh datasets cache (HF_DATASETS_CACHE), in this order:

  dpo cold          recipes/dpo.py: read, check and tokenise every pair (rank 0, over every core)
  dpo cached        the same again: the tokenised pairs read back
  dpo_full cold     recipes/dpo_full.py on the cached pairs: the model as loaded scores every pair once
                    (the reference log-probabilities, sharded over the processes)
  dpo_full cached   the same again: the scores read back

`--recipe kto`: kto.py and kto_full.py in their places (each pair two judged replies, so twice the rows, each
with its mismatched row); `--no-full` leaves out the full-weight launches (their reference pass is a forward of
every row and takes the longest).

Per launch: wall seconds, each rank's peak resident memory by the start-up line (loading and the
reference pass) and with the first step (run.json's host_peak_*_gib_by_rank), and the lines the recipe
printed about the data and the reference. Writes --out/results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "measure"))

from prepare_speed import sentence  # noqa: E402

def launches(recipe: str, full: bool) -> list[tuple[str, str]]:
    return [(name, cache) for name in (recipe, f"{recipe}_full")[:2 if full else 1] for cache in ("cold", "cached")]


def pairs_file(path: Path, count: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    replies = [" ".join(sentence(rng) for _ in range(rng.randint(1, 4))) for _ in range(997)]
    with path.open("w") as out:
        for _ in range(count):
            turns = [{"role": "system", "content": sentence(rng)}] if rng.random() < 0.5 else []
            for _ in range(rng.randint(1, 2)):
                turns.append({"role": "user", "content": " ".join(sentence(rng) for _ in range(rng.randint(1, 2)))})
                turns.append({"role": "assistant", "content": rng.choice(replies)})
            other = rng.choice([reply for reply in replies[:8] if reply != turns[-1]["content"]])
            rejected = turns[:-1] + [{"role": "assistant", "content": other}]
            out.write(json.dumps({"chosen": turns, "rejected": rejected}) + "\n")
    return path


def launch(recipe: str, pairs: Path, output_dir: Path, cache: Path) -> dict:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "accelerate_configs" / "ddp.yaml"), "--num_processes", "2", "--mixed_precision", "no",
               str(REPO / "recipes" / f"{recipe}.py"), "--dataset", str(pairs), "--max-steps", "1",
               "--max-length", "1024", "--batch-size", "4", "--output-dir", str(output_dir), "--log-every", "1"]
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise SystemExit(f"{recipe} failed ({done.returncode}):\n{output[-3000:]}")
    record = json.loads((output_dir / "run.json").read_text())
    return {"recipe": recipe, "seconds": round(seconds, 1),
            "peak_at_start_gib_by_rank": record["host_peak_at_start_gib_by_rank"],
            "peak_with_first_step_gib_by_rank": record["host_peak_gib_by_rank"],
            "lines": [line for line in output.splitlines() if line.startswith(("data (", "data: ", "reference:"))
                      and not line.startswith("data: chat rows")],
            "command": " ".join(command[2:])}


def table(runs: list[dict]) -> str:
    rows = ["| launch | seconds | peak by start-up, rank 0 / 1 (GiB) | with the first step | what it printed |",
            "|---|---|---|---|---|"]
    for run in runs:
        rows.append(f"| {run['recipe']} {run['cache']} | {run['seconds']} | "
                    f"{' / '.join(map(str, run['peak_at_start_gib_by_rank']))} | "
                    f"{' / '.join(map(str, run['peak_with_first_step_gib_by_rank']))} | "
                    f"{'<br>'.join(line.replace('|', '/') for line in run['lines'])} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--pairs", type=int, default=100_000)
    parser.add_argument("--recipe", choices=("dpo", "kto"), default="dpo")
    parser.add_argument("--no-full", action="store_true", help="leave out dpo_full.py / kto_full.py")
    parser.add_argument("--out", type=Path, default=None, help="write results.json and results.md here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        pairs = pairs_file(root / "pairs.jsonl", args.pairs)
        runs = []
        for recipe, cache in launches(args.recipe, not args.no_full):
            run = launch(recipe, pairs, root / f"{recipe}-{cache}", root / "datasets-cache")
            runs.append({**run, "cache": cache})
            print(f"{recipe} {cache}: {run['seconds']} s, peak by start-up {run['peak_at_start_gib_by_rank']} GiB",
                  flush=True)
    flags = f"{' --recipe kto' if args.recipe == 'kto' else ''}{' --no-full' if args.no_full else ''}"
    text = (f"# Preference tuning ({args.recipe}) on {args.pairs:,} generated pairs (CPU, 2 processes, {date.today()})\n\n"
            f"`python scripts/measure/preference_speed.py{flags} --pairs {args.pairs} --out <this folder>` on {os.cpu_count()} "
            "CPU cores, no GPU; the bundled tiny model. Each launch's command is in results.json.\n\n"
            + table(runs) + "\n")
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"recipe": args.recipe, "pairs": args.pairs, "cpus": os.cpu_count(),
                                                           "date": str(date.today()), "runs": runs}, indent=2) + "\n")
        (args.out / "results.md").write_text(text)


if __name__ == "__main__":
    main()
