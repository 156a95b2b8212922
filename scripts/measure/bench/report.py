"""The results: results.md (the table beside the reference, how the numbers are made, the commands),
results.json, and the chart, in one folder per day, device and versions."""

from __future__ import annotations

import json
from pathlib import Path

from bench.chart import write_chart
from bench.formatting import format_duration, percent
from bench.reference import (
    REFERENCE,
    REFERENCE_PEAK_TFLOPS,
    REFERENCE_TOKENS,
    find_reference,
    reference_rows,
)
from bench.timing import WALL_RULE
from bench.workloads import STRATEGIES, WORKLOADS


def memory_cell(row: dict) -> str:
    if row.get("peak_allocated_gib") is None:
        return "n/a"
    planned = f" (planned {row['planned_peak_gib']:.1f})" if row.get("planned_peak_gib") is not None else ""
    return f"{row['peak_allocated_gib']:.1f} / {row['peak_reserved_gib']:.1f}{planned}"


def markdown_table(rows: list[dict]) -> str:
    header = ("| workload | strategy | source | GPUs | wall time | tokens/s/GPU | MFU | utilisation (recompute incl.) "
              "| GPU util (NVML) | peak mem alloc / reserved (GiB) | reference wall time | vs reference |")
    lines = [header, "|" + "---|" * 12]
    order = {name: i for i, name in enumerate(WORKLOADS)}
    strategy_order = {name: i for i, name in enumerate(STRATEGIES)}
    ours = sorted(rows, key=lambda r: (order.get(r["workload"], 99), strategy_order.get(r["strategy"], 99)))
    for workload in sorted({r["workload"] for r in ours} | {r["workload"] for r in REFERENCE},
                           key=lambda name: order.get(name, 99)):
        references = [ref for ref in reference_rows() if ref["workload"] == workload]
        mine = [row for row in ours if row["workload"] == workload]
        strategies = sorted({r["strategy"] for r in references + mine}, key=lambda s: strategy_order.get(s, 99))
        for strategy in strategies:
            for ref in (r for r in references if r["strategy"] == strategy):
                lines.append(
                    f"| {ref['workload_label']} | {ref['strategy_label']} | reference ({ref['device']}) | "
                    f"{ref['gpus']} | {ref['wall']} | {ref['tokens_per_s_per_gpu']:,.0f} | {percent(ref['mfu'])}* | — "
                    f"| {ref['gpu_util']} | — | — | — |")
            for row in (r for r in mine if r["strategy"] == strategy):
                layers = "" if row["layers"] == row["full_layers"] else f", {row['layers']} of {row['full_layers']} layers"
                source = f"ours ({row['device']}{layers})"
                ref = find_reference(row["workload"], row["strategy"])
                if row.get("status") != "ok":
                    lines.append(f"| {row['workload_label']} | {row['strategy_label']} | {source} | {row['gpus']} | "
                                 f"failed: {row.get('error', '')[:120].replace('|', '/')} | | | | | | "
                                 f"{ref['wall'] if ref else '—'} | |")
                    continue
                versus = f"{ref['wall_s'] / row['wall_s']:.2f}x faster" if ref else "—"
                if ref and row["layers"] != row["full_layers"]:
                    versus = f"not comparable ({row['layers']} of {row['full_layers']} layers)"
                lines.append(
                    f"| {row['workload_label']} | {row['strategy_label']} | {source} | {row['gpus']} | "
                    f"{format_duration(row['wall_s'])} | {row['tokens_per_s_per_gpu']:,.0f} | {percent(row['mfu'])} | "
                    f"{percent(row['utilisation'])} | {percent(row.get('gpu_util'))} | {memory_cell(row)} | "
                    f"{ref['wall'] if ref else '—'} | {versus} |")
                estimate = row.get("scaled_estimate")
                if estimate:
                    versus = f"{ref['wall_s'] / estimate['wall_s']:.2f}x faster" if ref else "—"
                    lines.append(
                        f"| {row['workload_label']} | {row['strategy_label']} | ESTIMATE for {estimate['layers']} "
                        f"layers, scaled from the {row['layers']}-layer run (not measured) | {row['gpus']} | "
                        f"~{format_duration(estimate['wall_s'])} | ~{estimate['tokens_per_s_per_gpu']:,.0f} | "
                        f"(as measured) | | | | {ref['wall'] if ref else '—'} | {versus} (estimate) |")
    return "\n".join(lines)


def notes(environment: dict, rows: list[dict]) -> list[str]:
    out = [
        f"Wall time: {WALL_RULE}.",
        "tokens/s/GPU: real tokens (metrics.jsonl `tokens`: every token but one BOS per row for the `text` "
        "data) / wall time / GPUs. Model parallel counts all the GPUs it spreads over.",
        "MFU = tokens/s x FLOP/token / (GPUs x peak), FLOP/token = 4N + 12·L·h·s for LoRA (N: matmul parameters "
        "incl. lm_head, excl. embeddings). Utilisation (recompute incl.) uses 6N + 16·L·h·s when the run used "
        "--gradient-checkpointing and equals MFU otherwise.",
        f"Peak: {environment['peak_tflops']:g} TFLOP/s per device; source: {environment['peak_source']}.",
        "GPU util: NVML utilisation averaged over the GPUs and over the training steps (sampled every 0.5 s); "
        "NVML counts communication kernels as busy, so it is a secondary figure. n/a: no NVML (CPU, or neither "
        "pynvml / nvidia-ml-py nor nvidia-smi available).",
        "Peak memory: the maximum of metrics.jsonl's peak_allocated_gib / peak_reserved_gib, i.e. rank 0 "
        "(model parallel: the first GPU); (planned N): the planner's per-GPU peak for the same launch "
        "(recipes/planner, the busiest GPU).",
        f"* Reference MFU: computed here from the published time, assuming {REFERENCE_TOKENS:,} real tokens per "
        f"epoch and {REFERENCE_PEAK_TFLOPS:g} TFLOP/s dense bf16 per RTX 6000 Ada; the reference did not publish "
        "LoRA rank / targets, data, precision or padding.",
    ]
    if environment["devices"] > 1 and any(row["strategy"] == "model_parallel" for row in rows):
        out.append(f"Global batch: the recipe flags are per process (as in the reference), so model parallel "
                   f"(1 process) takes {environment['devices']}x more, {environment['devices']}x smaller optimizer "
                   f"steps than the data-parallel strategies on {environment['devices']} devices over the same epoch.")
    if environment.get("measured_tflops"):
        out.append(f"Measured: {environment['measured_tflops']:.0f} TFLOP/s ({environment['measured_with']}).")
    if any(row.get("scaled_estimate") for row in rows):
        out.append("Rows marked ESTIMATE are not measurements: " + next(
            row["scaled_estimate"]["method"] for row in rows if row.get("scaled_estimate")) + ".")
    return out


def write_results(folder: Path, environment: dict, new_rows: list[dict]) -> list[dict]:
    """results.json / results.md / chart.png; rows of other workloads or strategies already in
    results.json (an earlier run on the same day, device and versions) are kept, same ones replaced."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    previous = folder / "results.json"
    if previous.exists():
        try:
            rows = json.loads(previous.read_text()).get("rows", [])
        except ValueError:
            rows = []
    replaced = {(row["workload"], row["strategy"]) for row in new_rows}
    rows = [row for row in rows if (row["workload"], row["strategy"]) not in replaced] + new_rows
    document = {"environment": environment, "wall_rule": WALL_RULE, "reference": reference_rows(), "rows": rows,
                "notes": notes(environment, rows)}
    previous.write_text(json.dumps(document, indent=2, default=str) + "\n")
    table = markdown_table(rows)
    md = [f"# Benchmark: {environment['device_label']}", "",
          f"{environment['date']}, torch {environment['versions'].get('torch')}, transformers "
          f"{environment['versions'].get('transformers')}, accelerate {environment['versions'].get('accelerate')}, "
          f"peft {environment['versions'].get('peft')}, deepspeed {environment['versions'].get('deepspeed')}", "",
          table, "", "![wall time per strategy](chart.png)", "", "## How the numbers are made", ""]
    md += [f"- {note}" for note in document["notes"]]
    md += ["", "## Commands", ""] + [f"- {row['strategy']}: `{row['command']}`" for row in rows]
    (folder / "results.md").write_text("\n".join(md) + "\n")
    write_chart(rows, folder / "chart.png")
    return rows
