#!/usr/bin/env python
"""Speed of recipes/lora.py beside TRL's SFTTrainer on rows with images (a vision-language model), one process and
two (DDP), on this machine:

    python scripts/measure/compare_trl_vlm.py                                   # tiny Qwen2-VL, data/vision, 3 rounds
    python scripts/measure/compare_trl_vlm.py --model models/tiny-llava --output-dir outputs/compare_trl_vlm-llava
    python scripts/measure/compare_trl_vlm.py --rounds 1 --steps 6 --processes 1  # a quick check

Both sides go through the real `accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes P
--mixed_precision no` with the same flags: ours is recipes/lora.py, TRL's scripts/measure/trl_vlm_worker.py
--recipe-order (SFTTrainer set up as the recipe runs; its docstring lists every setting). They train the same thing:
the model (default the tiny random Qwen2-VL, built by scripts/build_tiny_model.py --family qwen2-vl on first use;
--model models/tiny-llava builds that one), the bundled vision task's training rows (data/vision: one image a row,
a short answer) in the recipe's micro-batches on the same ranks, LoRA on the language model, the recipe's optimizer,
schedule and clipping, float32 on CPU. This script checks that both sides count the same target tokens at every step
of every run (it stops otherwise) and prints both sides' step-1 loss beside each other (TRL logs it; the same model,
adapter and rows give the same number).

Timed: the loop, from the end of step 1 to the end of the last step (start-up, loading, data preparation and the
first step's warm-up left out): seconds a step and target tokens (the answer tokens the loss is computed on) a
second; and each side's end to end, from the launch to its exit (the adapter saved): start-up, reading the rows and
images, loading, the loop, and what each side does after it (the recipe: its evaluation on the held-out rows,
data/vision/eval.jsonl, three sample answers, the adapter and model card; TRL's worker: the adapter), split into
before the loop (to the line each side prints where its step clock starts), the loop and after it.

The 2 CPU cores may be shared: the two sides alternate within each round (the side that goes first swaps every
round, so drift reaches both), and each run records the 1-minute load average and how busy the CPU was just before
it. Medians and spread ((max - min) / median) over the rounds.

Writes <output-dir>/summary.json (every run and the tables' numbers) and prints two tables (markdown) last: where each
side's end to end goes, then the loop and end to end beside each other. Each
run's files and logs are in <output-dir>/p<P>-round<R>-<side>/. A launch that fails ends the script with one line
and its stderr's tail.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "measure"))
# The text-rows harness's launch, timing and failure report (torch-free)
from compare_trl import (DDP_CONFIG, LaunchFailed, free_port, launched, spread, threads_per_process,  # noqa: E402
                         timed_part)

TINY = {"models/tiny-qwen2-vl": "qwen2-vl", "models/tiny-llava": "llava"}  # the bundled builder's folders
SIDES = {"ours": ("ours", REPO / "recipes" / "lora.py"),
         "trl": ("TRL", REPO / "scripts" / "measure" / "trl_vlm_worker.py")}
# the line each side prints where its step clock (metrics.jsonl's elapsed_s) starts: the recipe's run line (RunLog),
# the worker's on_train_begin
CLOCK_LINES = {"ours": "lora: ", "trl": "trl: training"}


def parse_args(argv=None):
    summary, _, details = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default="models/tiny-qwen2-vl", help="the vision-language model both sides train")
    add("--dataset", default="data/vision", help="chat rows with images, one reply a row")
    add("--steps", type=int, default=60, help="optimizer steps a run (step 1 is warm-up, not timed)")
    add("--batch-size", type=int, default=8, help="micro-batch per process")
    add("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    add("--processes", default="1,2", help="comma-separated process counts, each timed (2: DDP)")
    add("--rounds", type=int, default=3, help="alternations of the two sides, for each process count")
    add("--seed", type=int, default=42)
    add("--output-dir", default="outputs/compare_trl_vlm", help="where each run and summary.json go")
    add("--timeout", type=int, default=900, help="seconds one launch may take")
    add("--report", default=None, metavar="SUMMARY_JSON",
        help="print the tables of an earlier run's summary.json (its runs summarised again) and run nothing")
    args = parser.parse_args(argv)
    args.processes = [int(count) for count in args.processes.split(",")]
    if args.steps < 2 or min(args.batch_size, args.grad_accum, args.rounds, *args.processes) < 1:
        parser.error("--steps must be at least 2 (step 1 is not timed); the other counts at least 1")
    return args


def ensure_model(model: str) -> None:
    """Build a bundled tiny vision-language model on first use (both sides load it from its folder)."""
    family = TINY.get(Path(model).as_posix().removeprefix("./"))
    if family and not (REPO / model / "config.json").exists():
        subprocess.run([sys.executable, "scripts/build_tiny_model.py", "--family", family], cwd=REPO, check=True)


def launch_command(side: str, output_dir: Path, args, processes: int) -> list[str]:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(DDP_CONFIG),
               "--num_processes", str(processes), "--mixed_precision", "no"]
    if processes > 1:
        command += ["--main_process_port", str(free_port())]
    command += [str(SIDES[side][1]), "--output-dir", str(output_dir), "--model", args.model, "--dataset", args.dataset,
                "--max-steps", str(args.steps), "--batch-size", str(args.batch_size), "--grad-accum",
                str(args.grad_accum), "--seed", str(args.seed)]
    if side == "ours":  # no tracker, no progress lines, evaluation only after the last (timed) step
        return command + ["--report-to", "none", "--log-every", "0", "--eval-every", "0", "--no-eval-on-start"]
    return command + ["--recipe-order"]


def run_side(side: str, processes: int, round_number: int, args) -> dict:
    output_dir = Path(args.output_dir).resolve() / f"p{processes}-round{round_number}-{side}"
    done = launched(launch_command(side, output_dir, args, processes), output_dir,
                    f"the {SIDES[side][0]} launch of round {round_number} ({processes} process(es))", processes,
                    args.timeout)
    return record_of(side, processes, round_number, done)


def record_of(side: str, processes: int, round_number: int, done: dict) -> dict:
    """One run's figures from its launch (compare_trl.launched): the loop's, the end to end and its three parts, the
    step-1 loss. The parts: before the loop (the launch to the line its program prints where its step clock starts),
    the loop (that clock at the last step's end: step 1 included) and after it (the rest, to the program's exit)."""
    timed = timed_part(done["records"])
    train = sorted((r for r in done["records"] if r.get("type") == "train"), key=lambda r: r["step"])
    clock_at = next((at for at, line in done["stdout_lines"] if line.startswith(CLOCK_LINES[side])), None)
    loop_s = train[-1]["elapsed_s"]
    parts = ({"before_loop_s": clock_at, "loop_s": loop_s, "after_loop_s": done["end_to_end_s"] - clock_at - loop_s}
             if clock_at is not None else {"before_loop_s": None, "loop_s": loop_s, "after_loop_s": None})
    # each step's own time, steps 2..N: their median sets aside a burst of slow steps (another job on the cores)
    durations = [later["elapsed_s"] - earlier["elapsed_s"] for earlier, later in zip(train, train[1:])]
    return {"processes": processes, "round": round_number, "side": side,
            "step_s": timed["timed_s"] / (timed["steps"] - 1), "median_step_s": statistics.median(durations),
            "tokens_per_s": timed["tokens_per_s"], "timed_tokens": timed["timed_tokens"],
            "step_tokens": timed["step_tokens"], "step1_loss": train[0].get("loss"),
            "end_to_end_s": done["end_to_end_s"],
            **parts, "load_1min_before": done["load_1min_before"], "cpu_busy_before": done["cpu_busy_before"]}


def summarise(runs: list[dict]) -> list[dict]:
    """A row per process count: each side's medians and spreads over its rounds, ours / TRL."""
    rows = []
    for processes in sorted({run["processes"] for run in runs}):
        side = {name: [run for run in runs if run["processes"] == processes and run["side"] == name] for name in SIDES}
        row = {"processes": processes, "rounds": len(side["ours"])}
        for name, kept in side.items():
            for key in ("step_s", "median_step_s", "tokens_per_s", "end_to_end_s"):
                values = [run[key] for run in kept]
                row[f"{name}_{key}"] = statistics.median(values)
                row[f"{name}_{key}_spread"] = spread(values)
            row[f"{name}_step1_loss"] = kept[0]["step1_loss"]
            for key in ("before_loop_s", "loop_s", "after_loop_s"):
                values = [run[key] for run in kept if run[key] is not None]
                row[f"{name}_{key}"] = statistics.median(values) if values else None
        row["tokens_per_s_ratio"] = row["ours_tokens_per_s"] / row["trl_tokens_per_s"]
        row["end_to_end_ratio"] = row["ours_end_to_end_s"] / row["trl_end_to_end_s"]
        # each round's two runs ran back to back, under about the same load: their ratios, then the median of those
        pairs = [(ours, trl) for ours in side["ours"] for trl in side["trl"] if ours["round"] == trl["round"]]
        row["paired_tokens_per_s_ratio"] = statistics.median(ours["tokens_per_s"] / trl["tokens_per_s"]
                                                             for ours, trl in pairs)
        row["paired_end_to_end_ratio"] = statistics.median(ours["end_to_end_s"] / trl["end_to_end_s"]
                                                           for ours, trl in pairs)
        row["paired_median_step_ratio"] = statistics.median(trl["median_step_s"] / ours["median_step_s"]
                                                            for ours, trl in pairs)
        loads = [run["load_1min_before"] for run in runs
                 if run["processes"] == processes and run["load_1min_before"] is not None]
        row["load_1min"] = (min(loads), statistics.median(loads), max(loads)) if loads else None
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The markdown table of `summarise`'s rows: each side's median (spread) over its runs, of each run's mean step
    (its target tokens/s), of each run's median step, and of its end to end; ours / TRL: the ratio of the two
    medians, and in bold the median of the rounds' own ratios (each round's two runs back to back)."""
    def cell(row, name, key, form):
        return f"{format(row[f'{name}_{key}'], form)} ({row[f'{name}_{key}_spread']:.0%})"

    lines = ["| processes | rounds | s/step ours | s/step TRL | target tokens/s ours | target tokens/s TRL | "
             "tokens/s ours / TRL (of the medians; paired) | median step ours (s) | median step TRL (s) | "
             "median step TRL / ours (paired) | end to end ours (s) | end to end TRL (s) | "
             "end to end ours / TRL (of the medians; paired) | step-1 loss ours | step-1 loss TRL | "
             "load (1 min) min / median / max |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        load = " / ".join(f"{value:.2f}" for value in row["load_1min"]) if row["load_1min"] else "n/a"
        losses = [f"{row[f'{name}_step1_loss']:.6f}" if row[f"{name}_step1_loss"] is not None else "n/a"
                  for name in SIDES]
        lines.append(f"| {row['processes']} | {row['rounds']} | {cell(row, 'ours', 'step_s', '.4f')} | "
                     f"{cell(row, 'trl', 'step_s', '.4f')} | {cell(row, 'ours', 'tokens_per_s', '.0f')} | "
                     f"{cell(row, 'trl', 'tokens_per_s', '.0f')} | {row['tokens_per_s_ratio']:.2f}; "
                     f"**{row['paired_tokens_per_s_ratio']:.2f}** | {cell(row, 'ours', 'median_step_s', '.4f')} | "
                     f"{cell(row, 'trl', 'median_step_s', '.4f')} | **{row['paired_median_step_ratio']:.2f}** | "
                     f"{cell(row, 'ours', 'end_to_end_s', '.1f')} | "
                     f"{cell(row, 'trl', 'end_to_end_s', '.1f')} | {row['end_to_end_ratio']:.2f}; "
                     f"**{row['paired_end_to_end_ratio']:.2f}** | {losses[0]} | {losses[1]} | {load} |")
    return "\n".join(lines)


def parts_table(rows: list[dict]) -> str:
    """Where each side's end to end goes (medians over the rounds): before the loop, the loop, after it."""
    def seconds(value):
        return "n/a" if value is None else f"{value:.1f}"

    lines = ["| processes | side | before the loop (s) | the loop (s) | after the loop (s) | end to end (s) |",
             "|---:|---|---:|---:|---:|---:|"]
    for row in rows:
        for name, (label, _) in SIDES.items():
            lines.append(f"| {row['processes']} | {label} | {seconds(row[f'{name}_before_loop_s'])} | "
                         f"{seconds(row[f'{name}_loop_s'])} | {seconds(row[f'{name}_after_loop_s'])} | "
                         f"{seconds(row[f'{name}_end_to_end_s'])} |")
    return "\n".join(lines)


def revision() -> dict:
    """The commit measured, and the files under recipes/ and scripts/measure/ that differ from it (a shared tree)."""
    def git(*command):
        done = subprocess.run(["git", *command], cwd=REPO, capture_output=True, text=True)
        return done.stdout.rstrip() if done.returncode == 0 else None

    changed = git("status", "--porcelain", "--", "recipes", "scripts/measure")
    return {"commit": (git("rev-parse", "--short", "HEAD") or "").strip() or None,
            "changed": [line[3:] for line in changed.splitlines()] if changed else []}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "n/a"


def report(path: str) -> int:
    rows = summarise(json.loads(Path(path).read_text())["runs"])
    print(parts_table(rows))
    print()
    print(table(rows))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        return report(args.report)
    ensure_model(args.model)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"workload: {args.model} + LoRA, {args.dataset}, {args.steps} steps of batch {args.batch_size} x grad-accum "
          f"{args.grad_accum} x {'/'.join(map(str, args.processes))} process(es), fp32, {os.cpu_count()} CPU cores, "
          f"{'/'.join(str(threads_per_process(p)) for p in args.processes)} torch thread(s) per process", flush=True)
    started_at = uptime()
    print(f"uptime before: {started_at}", flush=True)
    runs = []
    try:
        for round_number in range(1, args.rounds + 1):
            order = ("ours", "trl") if round_number % 2 else ("trl", "ours")
            for processes in args.processes:
                for side in order:
                    runs.append(run_side(side, processes, round_number, args))
                    run = runs[-1]
                    print(f"p{processes} round {round_number} {SIDES[side][0]:<4} {run['step_s'] * 1000:7.1f} ms/step  "
                          f"{run['tokens_per_s']:7.1f} target tokens/s  end to end {run['end_to_end_s']:.1f} s  "
                          f"(before the loop {run['before_loop_s']} s, after {run['after_loop_s'] and round(run['after_loop_s'], 1)} s)  "
                          f"step-1 loss {run['step1_loss']}  load {run['load_1min_before']:.2f}", flush=True)
    except LaunchFailed as failure:
        tail, message = failure.args
        print("\n".join(f"  | {line}" for line in tail), file=sys.stderr)
        print(f"error: {message}", file=sys.stderr)
        return 1
    for processes in args.processes:  # every run of a process count trained on the same target tokens, step by step
        kept = [run for run in runs if run["processes"] == processes]
        differing = [run for run in kept if run["step_tokens"] != kept[0]["step_tokens"]]
        if differing:
            print(f"error: {processes} process(es): round {differing[0]['round']} {differing[0]['side']} trained on other "
                  f"target tokens than round 1's {kept[0]['side']}; the comparison is void", file=sys.stderr)
            return 1
    rows = summarise(runs)
    ended_at = uptime()
    summary = {"arguments": {**vars(args), "processes": args.processes}, "revision": revision(), "uptime_before": started_at,
               "uptime_after": ended_at, "cpu_cores": os.cpu_count(), "rows": rows, "runs": runs}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"uptime after: {ended_at}")
    print(f"every run of a process count trained on the same target tokens at every step; summary in {out / 'summary.json'}")
    print(parts_table(rows))
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
