"""Draw the loss and evaluation curves of one or more runs in one picture, to compare strategies.

    python scripts/plot.py outputs/ddp outputs/fsdp outputs/zero3 --output curves.png
    python scripts/plot.py outputs/ddp/metrics.jsonl outputs/fsdp --labels ddp,fsdp --x tokens

Each argument is a run folder (the recipe's --output-dir) or its metrics.jsonl. Three panels:
training loss, evaluation loss and evaluation exact match, one colour per run (for grpo.py's runs: the
training reward, the completions' length and the held-out prompts' reward). A run's label is
its folder, followed by the strategy and process count from run.json when there is one
("outputs/ddp (MULTI_GPU x 4)"). A run resumed with --resume auto appends to its metrics.jsonl;
a step logged twice is drawn once, from its latest record, and --x tokens / time add up the
restarts. Needs no display and no GPU.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

X_LABELS = {
    "step": "optimizer step",
    "tokens": "target tokens seen (all ranks)",
    "time": "wall-clock time, restarts summed",
}


class PlotError(Exception):
    """A problem with the user's input: reported as one `error:` line, exit status 2."""


@dataclass
class Run:
    label: str
    metrics: Path
    train: list[dict] = field(default_factory=list)  # one record per step, in step order
    evals: list[dict] = field(default_factory=list)

    def x_of_steps(self, axis: str) -> dict[int, float]:
        """Step -> position on the x axis: the step, tokens seen, or seconds of training."""
        if axis == "step":
            return {r["step"]: r["step"] for r in self.train}
        key = "tokens" if axis == "tokens" else "seconds"
        total, positions = 0.0, {}
        for record in self.train:
            value = number(record.get(key))
            total += 0.0 if math.isnan(value) else value
            positions[record["step"]] = total
        return positions


def metrics_file(path: Path) -> Path:
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path} not found: give a run folder (a recipe's --output-dir) or its metrics.jsonl")
    return path


def default_label(metrics: Path) -> str:
    label = str(metrics.parent)
    run_json = metrics.parent / "run.json"
    if run_json.is_file():
        try:
            record = json.loads(run_json.read_text())
        except (json.JSONDecodeError, OSError):
            return label
        if record.get("distributed_type") and record.get("num_processes"):
            label += f" ({record['distributed_type']} x {record['num_processes']})"
    return label


def read_run(metrics: Path, label: str) -> Run:
    """Read a metrics.jsonl written by recipes/common/outputs/runlog.py.

    Every start of the recipe restarts `elapsed_s` and `tokens_seen`, so a record's own seconds
    are its `elapsed_s` minus that of the record before it in the same process. A step logged
    again after a resume replaces the earlier record. A line cut short by a crash is skipped.
    """
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    previous = None
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            continue
        if record.get("type") == "train" and "loss" in record:
            elapsed = number(record.get("elapsed_s"))
            restarted = previous is None or not (
                elapsed >= number(previous.get("elapsed_s"))
                and number(record.get("tokens_seen")) > number(previous.get("tokens_seen")))
            record["seconds"] = elapsed if restarted else elapsed - number(previous.get("elapsed_s"))
            previous = record
            train[record["step"]] = record
        elif record.get("type") == "eval":
            evals[record["step"]] = record
    if not train and not evals:
        raise PlotError(f"{metrics} holds no train or eval records")
    return Run(label, metrics, [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)])


def number(value) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan


def running_mean(values: list[float], window: int) -> list[float]:
    """Each value's mean with the `window - 1` before it (fewer at the start; NaNs left out)."""
    means = []
    for index in range(len(values)):
        kept = [value for value in values[max(0, index - window + 1):index + 1] if not math.isnan(value)]
        means.append(sum(kept) / len(kept) if kept else math.nan)
    return means


def time_scale(seconds: float) -> tuple[float, str]:
    if seconds >= 3 * 3600:
        return 3600.0, "h"
    if seconds >= 3 * 60:
        return 60.0, "min"
    return 1.0, "s"


def draw(runs: list[Run], axis: str, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = [run.x_of_steps(axis) for run in runs]
    scale, unit = 1.0, ""
    if axis == "time":
        scale, unit = time_scale(max((max(p.values(), default=0.0) for p in positions), default=0.0))
        unit = f" ({unit})"
    colours = plt.get_cmap("tab10" if len(runs) <= 10 else "tab20").colors

    # An online run (grpo.py) logs rewards: its panels are the reward, the completions' length and the held-out
    # prompts' reward (its loss is near 0 by construction: the advantages of a group sum to 0).
    online = any("reward" in record for run in runs for record in run.train)
    train_key, eval_keys = ("reward", "completions/mean_length") if online else ("loss", None)
    titles = (["training reward", "completion length (tokens)", "eval reward"] if online else
              ["training loss", "eval loss", "eval exact match"])
    figure, (loss_ax, eval_ax, match_ax) = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = list(zip((loss_ax, eval_ax, match_ax), titles))
    for index, (run, position) in enumerate(zip(runs, positions)):
        colour = colours[index % len(colours)]
        xs = [position[r["step"]] / scale for r in run.train]
        if online:  # a step's reward is a few prompts' (noisy): each step faint, a running mean over it
            for ax, key in ((loss_ax, train_key), (eval_ax, eval_keys)):
                ys = [number(r.get(key)) for r in run.train]
                ax.plot(xs, ys, color=colour, linewidth=0.6, alpha=0.3)
                ax.plot(xs, running_mean(ys, max(1, len(ys) // 50)), color=colour, linewidth=1.4, label=run.label)
        else:
            loss_ax.plot(xs, [number(r.get(train_key)) for r in run.train], color=colour, linewidth=1.2,
                         label=run.label)

        # An eval point sits at the x of its step's training record (or of the nearest earlier one).
        known = sorted(position)
        eval_x = []
        for record in run.evals:
            at = bisect.bisect_right(known, record["step"])
            eval_x.append(position[known[at - 1]] / scale if at else (record["step"] if axis == "step" else 0.0))
        evaluated = ((match_ax, "eval_reward"),) if online else ((eval_ax, "eval_loss"), (match_ax, "eval_exact_match"))
        for ax, key in evaluated:
            ys = [number(r.get(key)) for r in run.evals]
            if any(not math.isnan(y) for y in ys):
                ax.plot(eval_x, ys, color=colour, marker="o", markersize=4, linewidth=1.2, label=run.label)

    for ax, title in panels:
        ax.set_title(title)
        ax.set_xlabel(X_LABELS[axis] + unit)
        ax.grid(True, alpha=0.3)
        if not ax.lines:
            ax.text(0.5, 0.5, "no records", ha="center", va="center", transform=ax.transAxes, color="grey")
    loss_ax.set_ylabel("reward" if online else "loss")
    match_ax.set_ylabel("reward" if online else "exact match")
    if match_ax.lines:
        match_ax.set_ylim(bottom=0)
    handles, labels = loss_ax.get_legend_handles_labels()
    if not handles:
        handles, labels = eval_ax.get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=min(len(runs), 3), frameon=False)
    rows = math.ceil(len(runs) / 3)
    figure.tight_layout(rect=(0, min(0.06 * rows, 0.4), 1, 1))
    output.parent.mkdir(parents=True, exist_ok=True)
    kind = output.suffix[1:].lower() or "png"
    if kind not in figure.canvas.get_supported_filetypes():
        plt.close(figure)
        raise PlotError(f"cannot write a .{kind} image; use .png (or .pdf, .svg)")
    figure.savefig(output, dpi=100, format=kind)
    plt.close(figure)


def summary(run: Run) -> str:
    parts = [f"{run.label}: {len(run.train)} step(s)"]
    if run.train:
        parts.append(f"last loss {number(run.train[-1]['loss']):.4f}")
        if "reward" in run.train[-1]:
            parts.append(f"last reward {number(run.train[-1]['reward']):.4f}")
    if run.evals:
        last = run.evals[-1]
        shown = ", ".join(f"{key} {number(last[key]):.4f}" for key in ("eval_loss", "eval_exact_match", "eval_reward")
                          if key in last)
        if shown:
            parts.append(f"at step {last['step']}: {shown}")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Draw training loss, eval loss and eval exact match of one or more runs (PNG).",
        epilog="example: python scripts/plot.py outputs/ddp outputs/fsdp --labels ddp,fsdp --x tokens")
    parser.add_argument("runs", nargs="+", type=Path,
                        help="run folders (a recipe's --output-dir) or metrics.jsonl files")
    parser.add_argument("--labels", help="comma-separated legend labels, one per run "
                                         "(default: the folder, with strategy x processes from run.json)")
    parser.add_argument("-o", "--output", type=Path, default=Path("curves.png"),
                        help="the image to write (default: curves.png); PNG, or PDF / SVG by its extension")
    parser.add_argument("--x", choices=sorted(X_LABELS), default="step",
                        help="x axis: optimizer step (default), target tokens seen, "
                             "or wall-clock time summed over restarts")
    args = parser.parse_args(argv)

    try:
        files = [metrics_file(path) for path in args.runs]
        if args.labels is not None:
            labels = [label.strip() for label in args.labels.split(",")]
            if len(labels) != len(files):
                raise PlotError(f"--labels gives {len(labels)} label(s) for {len(files)} run(s)")
        else:
            labels = [default_label(path) for path in files]
        runs = [read_run(path, label) for path, label in zip(files, labels)]
        draw(runs, args.x, args.output)
    except PlotError as problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    except OSError as problem:
        print(f"error: {problem.filename or ''}: {problem.strerror or problem}", file=sys.stderr)
        return 2
    for run in runs:
        print(summary(run))
    print(f"wrote {args.output} ({len(runs)} run(s), x = {args.x})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
