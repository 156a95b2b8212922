"""chart.png: the training-loop wall time per strategy, ours beside the reference, one panel per workload."""

from __future__ import annotations

from pathlib import Path

from bench.formatting import format_duration
from bench.reference import REFERENCE_HARDWARE, reference_rows
from bench.workloads import STRATEGIES, WORKLOADS


def write_chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [name for name in WORKLOADS if any(row["workload"] == name for row in rows)]
    figure, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    for axis, workload in zip(axes[0], workloads):
        mine = [row for row in rows if row["workload"] == workload]
        references = [ref for ref in reference_rows() if ref["workload"] == workload]
        strategies = [name for name in STRATEGIES if any(r["strategy"] == name for r in mine + references)]
        ours_label = f"ours ({mine[0]['device']}, measured)" if mine else "ours (measured)"
        reduced = next((row for row in mine if row["layers"] != row["full_layers"]), None)
        if reduced:
            ours_label = f"ours ({mine[0]['device']}, {reduced['layers']} of {reduced['full_layers']} layers, measured)"
        series = [(ours_label, "#1f77b4", "", lambda s: next(
                      (r["wall_s"] for r in mine if r["strategy"] == s and r.get("status") == "ok"), None))]
        if any(row.get("scaled_estimate") for row in mine):
            series.append((f"ours, scaled per layer to {mine[0]['full_layers']} layers "
                           "(estimate, not measured)", "#aec7e8", "//", lambda s: next(
                (r["scaled_estimate"]["wall_s"] for r in mine if r["strategy"] == s and r.get("scaled_estimate")),
                None)))
        if references:
            series.append((f"reference ({REFERENCE_HARDWARE})", "#ff7f0e", "", lambda s: next(
                (r["wall_s"] for r in references if r["strategy"] == s), None)))
        width = 0.8 / len(series)
        for i, (label, colour, hatch, value_of) in enumerate(series):
            xs, heights = [], []
            for j, strategy in enumerate(strategies):
                value = value_of(strategy)
                if value is not None:
                    xs.append(j + (i - (len(series) - 1) / 2) * width)
                    heights.append(value)
            bars = axis.bar(xs, heights, width, label=label, color=colour, hatch=hatch, edgecolor="black",
                            linewidth=0.5)
            axis.bar_label(bars, labels=[format_duration(h) for h in heights], fontsize=7, padding=2)
        for j, strategy in enumerate(strategies):
            if any(r["strategy"] == strategy and r.get("status") != "ok" for r in mine):
                axis.annotate("ours: failed", (j, 0), textcoords="offset points", xytext=(0, 4), ha="center",
                              fontsize=7, color="red")
        axis.set_xticks(range(len(strategies)), [STRATEGIES[s].label for s in strategies], rotation=15, fontsize=8)
        axis.set_ylabel("training-loop wall time (s)")
        axis.set_title(WORKLOADS[workload].label, fontsize=9)
        axis.legend(fontsize=7)
        axis.margins(y=0.15)
    figure.suptitle("One epoch, model loading and compile warm-up apart", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
