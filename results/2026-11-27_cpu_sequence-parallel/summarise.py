#!/usr/bin/env python
"""results.md from launches/*.json (each rank's USS peaks, launch_memory.py) and launches/*.metrics.jsonl."""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    print("| model | tokens a row | layout | USS peak, training steps (MiB, per rank) | USS peak, evaluation and "
          "saving (MiB) | seconds a step (median of steps 2-3) | losses |")
    print("|---|---:|---|---|---|---:|---|")
    for model in ("bundled-long", "wide"):
        for rows in ("8k", "16k"):
            for layout in ("one", "sp"):
                name = f"{model}-{rows}-{layout}"
                record = json.loads((HERE / "launches" / f"{name}.json").read_text())
                lines = (HERE / "launches" / f"{name}.metrics.jsonl").read_text().splitlines()
                steps = [entry for entry in map(json.loads, lines) if entry["type"] == "train"]
                elapsed = [entry["elapsed_s"] for entry in steps]
                seconds = statistics.median(b - a for a, b in zip(elapsed, elapsed[1:]))
                ranks = record["mib_by_rank"]
                training = " / ".join(f"{ranks[rank]['training']['uss']:,}" for rank in sorted(ranks))
                rest = " / ".join(f"{ranks[rank]['evaluation and saving']['uss']:,}" for rank in sorted(ranks))
                tokens = steps[0]["tokens"] + 1
                losses = ", ".join(f"{entry['loss']:.6f}" for entry in steps)
                label = "1 process" if layout == "one" else "sp.yaml, 2 processes"
                print(f"| {model} | {tokens:,} | {label} | {training} | {rest} | {seconds:.2f} | {losses} |")


if __name__ == "__main__":
    main()
