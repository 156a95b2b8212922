#!/usr/bin/env python
"""Speed of recipes/grpo.py beside TRL's GRPOTrainer (with TRL's own generation), one process and two (DDP), on the
user's clock and per step, with where each step's time goes:

    python scripts/measure/compare_trl_grpo.py --steps 20 --rounds 2 --output-dir outputs/compare_trl_grpo
    python scripts/measure/compare_trl_grpo.py --steps 4 --rounds 1 --processes 1    # a quick check
    python scripts/measure/compare_trl_grpo.py --report outputs/compare_trl_grpo/summary.json   # the tables again

Both sides go through the real `accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes P
--mixed_precision no` with the same flags: ours is recipes/grpo.py, TRL's scripts/measure/trl_grpo_worker.py
--trl-generation (it parses the recipe's own flags, so every default is the recipe's: the LoRA adapter's r, alpha,
dropout and targets, AdamW, lr, warm-up, cosine decay, clipping; GRPOConfig takes --num-generations,
--max-completion-length, --temperature, --top-k, --top-p, --loss, --beta). The same model (default the bundled tiny
Llama, random weights: no completion earns the reward, so both sides sample full-length completions and the adapter
does not move; give --model an SFT model for a run that learns), the same prompts (data/prompts/: ours reads the
folder, TRL its train.jsonl) and the same reward (recipes/rewards.py:exact_answer, the bundled prompts' reward).
Each step samples --batch-size x --grad-accum completions on each process (--num-generations of each prompt). Both
sample at random, each with its own generator: the completions differ, their lengths are printed beside each other.

Timed, for each run:
- end to end: from the launch to its exit, the adapter saved (the user's clock), split into before the loop (the
  launch to the line each side prints where its step clock starts: the recipe's `grpo: ` run line, the worker's
  `trl: training`), the loop (that clock at the last step's end) and after it (the recipe: its evaluation of the
  held-out prompts, greedy, data/prompts/eval.jsonl, then the adapter and model card; TRL's worker: the adapter).
  The recipe's evaluation before the first step is off (--no-eval-on-start; --eval-on-start puts it back): TRL's
  worker evaluates nothing. `final eval` is the recipe's held-out evaluation alone: from the last step's end to its
  `eval at step` line.
- per step: the median of steps 2..N (each step's own time, from metrics.jsonl's `elapsed_s`; step 1's warm-up left
  out), split into generation (ours: metrics.jsonl's `generation/seconds`, the slowest rank's; TRL: rank 0's seconds
  in `_generate_single_turn`), reward scoring (TRL: rank 0's seconds in `_calculate_rewards`; ours: the recipe's
  scoring (common/rewards.py's `score`) of as many completions, timed here, outside the launch) and the rest (the
  training step: forward, backward, optimizer, the step's collectives and logging).

The 2 CPU cores may be shared: the two sides alternate within each round (the side that goes first swaps every round),
each run records the 1-minute load average before it. Medians over the rounds. Writes <output-dir>/summary.json and
prints two markdown tables last: the user's clock, then the step's split (summary.json holds the runs so far after
each run: --report prints them should the script be stopped). Each run's files and logs are in
<output-dir>/p<P>-round<R>-<side>/. A launch that fails ends the script with one line and its stderr's tail.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "measure"))
sys.path.insert(0, str(REPO / "recipes"))
# The text-rows harnesses' launch, timing and failure report (torch-free)
from compare_trl import DDP_CONFIG, TINY_MODEL, LaunchFailed, ensure_tiny_model, free_port, launched  # noqa: E402
from compare_trl_vlm import revision, uptime  # noqa: E402

from common import rewards  # noqa: E402  (the recipe's reward loading and scoring, torch-free)

SIDES = {"ours": ("ours", REPO / "recipes" / "grpo.py"),
         "trl": ("TRL", REPO / "scripts" / "measure" / "trl_grpo_worker.py")}
# the line each side prints where its step clock (metrics.jsonl's elapsed_s) starts
CLOCK_LINES = {"ours": "grpo: ", "trl": "trl: training"}
EVAL_LINE = "eval at step "  # the recipe's line after its held-out evaluation


def parse_args(argv=None):
    summary, _, details = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default=str(TINY_MODEL), help="the model both sides train (default: the bundled tiny Llama)")
    add("--dataset", default="data/prompts", help="prompts: a folder with train.jsonl (and eval.jsonl), or a file")
    add("--reward", default="recipes/rewards.py:exact_answer", help="FILE.py:NAME, both sides")
    add("--steps", type=int, default=20, help="optimizer steps a run (step 1 is warm-up, not timed)")
    add("--batch-size", type=int, default=8, help="completions per micro-batch and process")
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    add("--num-generations", type=int, default=8, help="completions of each prompt")
    add("--max-completion-length", type=int, default=64, help="tokens a completion may have")
    add("--temperature", type=float, default=1.0)
    add("--top-k", type=int, default=0, help="0: all tokens")
    add("--processes", default="1,2", help="comma-separated process counts, each timed (2: DDP)")
    add("--rounds", type=int, default=1, help="alternations of the two sides, for each process count")
    add("--eval-on-start", action="store_true", help="let the recipe evaluate before its first step (its default)")
    add("--seed", type=int, default=42)
    add("--output-dir", default="outputs/compare_trl_grpo", help="where each run and summary.json go")
    add("--timeout", type=int, default=900, help="seconds one launch may take")
    add("--report", default=None, metavar="SUMMARY_JSON",
        help="print the tables of an earlier run's summary.json (its runs summarised again) and run nothing")
    args = parser.parse_args(argv)
    args.processes = [int(count) for count in args.processes.split(",")]
    if args.steps < 2 or min(args.batch_size, args.grad_accum, args.rounds, args.num_generations, *args.processes) < 1:
        parser.error("--steps must be at least 2 (step 1 is not timed); the other counts at least 1")
    return args


def trl_dataset(dataset: str) -> str:
    """The file TRL's worker reads: a folder's train.jsonl, else the file itself (the recipe reads either)."""
    path = Path(dataset) if Path(dataset).is_absolute() else REPO / dataset
    return str(path / "train.jsonl") if path.is_dir() else dataset


def workload_flags(args) -> list[str]:
    """The flags both sides get: the same model, reward, batch, sampling and seed (every other default is the
    recipe's on both: the worker parses the recipe's flags)."""
    return ["--model", args.model, "--reward", args.reward, "--max-steps", str(args.steps), "--batch-size",
            str(args.batch_size), "--grad-accum", str(args.grad_accum), "--num-generations", str(args.num_generations),
            "--max-completion-length", str(args.max_completion_length), "--temperature", str(args.temperature),
            "--top-k", str(args.top_k), "--seed", str(args.seed), "--samples-every", "0"]


def launch_command(side: str, output_dir: Path, args, processes: int, port: int | None = None) -> list[str]:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(DDP_CONFIG),
               "--num_processes", str(processes), "--mixed_precision", "no"]
    if processes > 1:
        command += ["--main_process_port", str(port or free_port())]
    command += [str(SIDES[side][1]), "--output-dir", str(output_dir), *workload_flags(args)]
    if side == "ours":  # no tracker, no progress lines
        return command + ["--dataset", args.dataset, "--report-to", "none", "--log-every", "0",
                          *([] if args.eval_on_start else ["--no-eval-on-start"])]
    return command + ["--dataset", trl_dataset(args.dataset), "--trl-generation"]


# where each side's metrics.jsonl keeps a step's generation seconds
GENERATION = {"ours": "generation/seconds", "trl": "generation_s"}


def record_of(side: str, processes: int, round_number: int, done: dict) -> dict:
    """One run's figures from its launch (compare_trl.launched): the end to end and its three parts (before the loop,
    the loop, after it; ours: its final evaluation within the last), the median step of steps 2..N and the median of
    its generation and scoring seconds, the completions' mean length."""
    train = sorted((r for r in done["records"] if r.get("type") == "train"), key=lambda r: r["step"])
    lines = done["stdout_lines"]
    clock_at = next((at for at, line in lines if line.startswith(CLOCK_LINES[side])), None)
    loop_s = train[-1]["elapsed_s"]
    steady = train[1:]
    durations = [later["elapsed_s"] - earlier["elapsed_s"] for earlier, later in zip(train, steady)]
    generation = [r[GENERATION[side]] for r in steady if GENERATION[side] in r]
    scoring = [r["rewards_s"] for r in steady if "rewards_s" in r]
    eval_at = next((at for at, line in lines if line.startswith(EVAL_LINE) and not line.startswith(EVAL_LINE + "0:")),
                   None)
    record = {"processes": processes, "round": round_number, "side": side, "steps": len(train),
              "end_to_end_s": done["end_to_end_s"], "loop_s": loop_s,
              "before_loop_s": clock_at, "after_loop_s": None if clock_at is None else
              done["end_to_end_s"] - clock_at - loop_s,
              "final_eval_s": None if clock_at is None or eval_at is None else eval_at - clock_at - loop_s,
              "median_step_s": statistics.median(durations),
              "mean_step_s": (loop_s - train[0]["elapsed_s"]) / len(steady),
              "median_generation_s": statistics.median(generation) if generation else None,
              "median_scoring_s": statistics.median(scoring) if scoring else None,
              "mean_completion_length": statistics.fmean(r["completions/mean_length"] for r in steady),
              "load_1min_before": done["load_1min_before"], "cpu_busy_before": done["cpu_busy_before"]}
    return record


def scoring_seconds(args, completions: int, repeats: int = 200) -> float:
    """The recipe's reward scoring of one step's completions on one process (common/rewards.py's `score`, as the
    recipe calls it), timed here: the median of `repeats`. The completions are random text as long as the run's."""
    functions = rewards.load_rewards([args.reward])
    rows = [json.loads(line) for line in Path(trl_dataset(args.dataset)).read_text().splitlines()[:completions]]
    rng = random.Random(args.seed)
    texts = ["".join(rng.choice("0123456789 abc") for _ in range(args.max_completion_length)) for _ in rows]
    columns = {name: [row[name] for row in rows] for name in rows[0] if name != "prompt"}
    columns["completion_ids"] = [[0] * args.max_completion_length for _ in rows]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        rewards.score(functions, [row["prompt"] for row in rows], texts, columns)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def median_of(runs: list[dict], key: str):
    values = [run[key] for run in runs if run[key] is not None]
    return statistics.median(values) if values else None


KEYS = ("end_to_end_s", "before_loop_s", "loop_s", "after_loop_s", "final_eval_s", "median_step_s", "mean_step_s",
        "median_generation_s", "median_scoring_s", "mean_completion_length")


def summarise(runs: list[dict], ours_scoring_s: float | None = None) -> list[dict]:
    """A row per process count: each side's medians over its rounds, ours / TRL of the end to end and of the step
    (of the medians, and paired: the median of each round's own ratio),
    and each side's step split into generation, scoring and the rest (ours' scoring: `ours_scoring_s`, timed
    outside the launch, where the runs have none)."""
    rows = []
    for processes in sorted({run["processes"] for run in runs}):
        row = {"processes": processes}
        for name in SIDES:
            kept = [run for run in runs if run["processes"] == processes and run["side"] == name]
            row["rounds"] = len(kept)
            for key in KEYS:
                row[f"{name}_{key}"] = median_of(kept, key)
        if row["ours_median_scoring_s"] is None:
            row["ours_median_scoring_s"] = ours_scoring_s
        for name in SIDES:
            parts = [row[f"{name}_median_generation_s"], row[f"{name}_median_scoring_s"]]
            row[f"{name}_rest_s"] = (row[f"{name}_median_step_s"] - sum(parts)) if None not in parts else None
        row["end_to_end_ratio"] = row["ours_end_to_end_s"] / row["trl_end_to_end_s"]
        row["step_ratio"] = row["ours_median_step_s"] / row["trl_median_step_s"]
        # each round's two runs ran back to back, under about the same load: their ratios, then the median of those
        pairs = [(ours, trl) for ours in runs for trl in runs if ours["processes"] == trl["processes"] == processes
                 and ours["round"] == trl["round"] and (ours["side"], trl["side"]) == ("ours", "trl")]
        for key, name in (("end_to_end_s", "end_to_end"), ("median_step_s", "step")):
            row[f"paired_{name}_ratio"] = (statistics.median(ours[key] / trl[key] for ours, trl in pairs)
                                           if pairs else None)
        loads = [run["load_1min_before"] for run in runs
                 if run["processes"] == processes and run["load_1min_before"] is not None]
        row["load_1min"] = (min(loads), statistics.median(loads), max(loads)) if loads else None
        rows.append(row)
    return rows


def seconds(value, form: str = ".1f") -> str:
    return "n/a" if value is None else format(value, form)


def clock_table(rows: list[dict]) -> str:
    """The user's clock: each side's end to end and its parts (medians over the rounds), ours / TRL."""
    lines = ["| processes | side | end to end (s) | before the loop (s) | the loop (s) | after the loop (s) | "
             "of which final eval (s) | ours / TRL end to end (of the medians; paired) | "
             "load (1 min) min / median / max |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        load = " / ".join(f"{value:.2f}" for value in row["load_1min"]) if row["load_1min"] else "n/a"
        for name, (label, _) in SIDES.items():
            lines.append(f"| {row['processes']} | {label} | {seconds(row[f'{name}_end_to_end_s'])} | "
                         f"{seconds(row[f'{name}_before_loop_s'])} | {seconds(row[f'{name}_loop_s'])} | "
                         f"{seconds(row[f'{name}_after_loop_s'])} | {seconds(row[f'{name}_final_eval_s'])} | "
                         + (f"{row['end_to_end_ratio']:.2f}; "
                            f"**{seconds(row['paired_end_to_end_ratio'], '.2f')}** | {load} |"
                            if name == "ours" else " | |"))
    return "\n".join(lines)


def step_table(rows: list[dict]) -> str:
    """The step (steps 2..N, medians): its seconds, split into generation, scoring and the rest, ours / TRL."""
    lines = ["| processes | side | median step (s) | mean step (s) | generation (s) | scoring (s) | the rest: the "
             "training step (s) | completion length (mean) | ours / TRL median step (of the medians; paired) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        for name, (label, _) in SIDES.items():
            lines.append(f"| {row['processes']} | {label} | {seconds(row[f'{name}_median_step_s'], '.3f')} | "
                         f"{seconds(row[f'{name}_mean_step_s'], '.3f')} | "
                         f"{seconds(row[f'{name}_median_generation_s'], '.3f')} | "
                         f"{seconds(row[f'{name}_median_scoring_s'], '.5f')} | "
                         f"{seconds(row[f'{name}_rest_s'], '.3f')} | "
                         f"{seconds(row[f'{name}_mean_completion_length'])} | "
                         + (f"{row['step_ratio']:.2f}; **{seconds(row['paired_step_ratio'], '.2f')}** |"
                            if name == "ours" else " |"))
    return "\n".join(lines)


def report(path: str) -> int:
    summary = json.loads(Path(path).read_text())
    rows = summarise(summary["runs"], summary.get("ours_scoring_s"))
    print(clock_table(rows))
    print()
    print(step_table(rows))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        return report(args.report)
    if Path(args.model) == TINY_MODEL:
        ensure_tiny_model()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"workload: {args.model} + LoRA, {args.dataset}, reward {args.reward}, {args.steps} steps of "
          f"{args.batch_size} x grad-accum {args.grad_accum} completions per process ({args.num_generations} a prompt, "
          f"at most {args.max_completion_length} tokens, temperature {args.temperature}, top-k {args.top_k}) x "
          f"{'/'.join(map(str, args.processes))} process(es), fp32, {os.cpu_count()} CPU cores", flush=True)
    started_at = uptime()
    print(f"uptime before: {started_at}", flush=True)
    runs = []
    try:
        for round_number in range(1, args.rounds + 1):
            order = ("ours", "trl") if round_number % 2 else ("trl", "ours")
            for processes in args.processes:
                for side in order:
                    output_dir = out.resolve() / f"p{processes}-round{round_number}-{side}"
                    done = launched(launch_command(side, output_dir, args, processes), output_dir,
                                    f"the {SIDES[side][0]} launch of round {round_number} ({processes} process(es))",
                                    processes, args.timeout)
                    runs.append(record_of(side, processes, round_number, done))
                    run = runs[-1]
                    # the runs so far, kept should a later one fail or be stopped (--report reads them)
                    (out / "summary.json").write_text(json.dumps({"partial": True, "runs": runs}, indent=2) + "\n")
                    print(f"p{processes} round {round_number} {SIDES[side][0]:<4} end to end "
                          f"{run['end_to_end_s']:.1f} s "
                          f"(before the loop {seconds(run['before_loop_s'])}, loop {run['loop_s']:.1f}, after "
                          f"{seconds(run['after_loop_s'])})  median step {run['median_step_s']:.3f} s (generation "
                          f"{seconds(run['median_generation_s'], '.3f')})  completion length "
                          f"{run['mean_completion_length']:.1f}  load {run['load_1min_before']:.2f}", flush=True)
    except LaunchFailed as failure:
        tail, message = failure.args
        print("\n".join(f"  | {line}" for line in tail), file=sys.stderr)
        print(f"error: {message}", file=sys.stderr)
        return 1
    ours_scoring = scoring_seconds(args, args.batch_size * args.grad_accum)
    rows = summarise(runs, ours_scoring)
    ended_at = uptime()
    summary = {"arguments": {**vars(args), "processes": args.processes}, "revision": revision(),
               "uptime_before": started_at, "uptime_after": ended_at, "cpu_cores": os.cpu_count(),
               "ours_scoring_s": ours_scoring, "rows": rows, "runs": runs}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"uptime after: {ended_at}")
    print(f"summary in {out / 'summary.json'}")
    print(clock_table(rows))
    print()
    print(step_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
