#!/usr/bin/env python
"""Tokens/s of recipes/lora.py against TRL's SFTTrainer on one tiny workload, on this machine.

    python scripts/measure/compare_trl.py                          # 3 rounds of (ours, TRL), 120 steps each
    python scripts/measure/compare_trl.py --rounds 1 --steps 6     # a quick check (the tests run this)

Both sides go through the real `accelerate launch --config_file accelerate_configs/ddp.yaml
--num_processes 2 --mixed_precision no`, with the same flags: ours is recipes/lora.py, TRL's is
scripts/measure/trl_sft_worker.py (SFTTrainer set up like the recipe; its docstring lists every setting).
They train the same thing:

- model and data: the bundled tiny Llama (built on first use) and data/train.jsonl, prompt masked;
- tokens: the same rows in the same micro-batches on the same ranks. The worker checks that TRL's
  tokenised rows are the recipe's (input_ids and trained positions); this script checks that the
  target tokens of every step are the same on both sides, and stops otherwise;
- LoRA r 16 / alpha 32 / dropout 0.05 on all linear layers, AdamW, lr 2e-4 with int(3% x steps)
  warm-up steps and cosine decay, gradient clipping at 1.0, seed 42, fp32 (or --mixed-precision bf16
  on GPUs), no gradient checkpointing, no evaluation, checkpoints or reporting while training;
- loss: both average the token losses over the whole global batch (all micro-batches and ranks):
  the recipe counts the step's target tokens itself, Trainer passes the same count to TRL
  (num_items_in_batch, average_tokens_across_devices);
- threads: OMP_NUM_THREADS = cores / processes for both launches, and the recipe sets the same
  (recipes/common/training/runtime.py); oversubscribed threads would make torch ~100x slower on a small CPU.

What is timed: the training loop only, from the end of step 1 to the end of the last step (start-up,
model loading, tokenisation and the first step's warm-up stay outside). Tokens are target tokens
(the response tokens the loss is computed on; prompt and padding are not counted) of steps 2..N, the
same kind on both sides. The recipe's clock is metrics.jsonl's `elapsed_s`; the worker's is a
TrainerCallback's on_step_end. Rounds alternate which side goes first, so that drift of the machine
reaches both.

Where the difference is likely to come from (read from TRL's and Trainer's code; no profile of TRL
is committed, docs/results.md has what was measured): for every micro-batch, TRL and Trainer gather
their logged metrics across ranks (entropy, token accuracy, token counts), count FLOPs and call
model.train(). These costs are fixed per micro-batch: large next to a 2-layer model on a CPU, small
next to a real model's compute on GPUs, so the ratio measured here says little about GPU runs.

Prints one line per run, the target tokens and mean loss of both sides, the median tokens/s of each,
what limits the comparison, the median end to end of each (from the launch to the adapter saved: start-up,
loading and tokenising too; x TRL's / ours) and, as the last line, `ratio: X` (median tokens/s of the loop,
ours / TRL).
<output-dir>/summary.json holds the same numbers; each run's files and logs are in
<output-dir>/round<R>-<side>/. A launch that fails ends the script with one line and its stderr's tail.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "measure"))
# Torch-free pieces of the benchmark (scripts/measure/bench/): launch ports, the timing rule.
from bench.launching import free_port  # noqa: E402
from bench.timing import steady_state  # noqa: E402

TINY_MODEL = REPO / "models" / "tiny-llama"
DDP_CONFIG = REPO / "accelerate_configs" / "ddp.yaml"
SIDES = {  # side -> (label, program that accelerate launches)
    "ours": ("ours", REPO / "recipes" / "lora.py"),
    "trl": ("TRL", REPO / "scripts" / "measure" / "trl_sft_worker.py"),
}


class LaunchFailed(Exception):
    """(the tail of the launch's stderr, a one-line description)"""


def parse_args(argv=None):
    summary, _, details = __doc__.partition("\n")
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--steps", type=int, default=120,
        help="optimizer steps per run (step 1 is warm-up, not timed; 120 keeps the timed part at seconds, not ms)")
    add("--batch-size", type=int, default=8, help="micro-batch per process")
    add("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    add("--max-length", type=int, default=512, help="tokens per row at most")
    add("--rounds", type=int, default=3, help="alternations of (ours, TRL)")
    add("--processes", type=int, default=2, help="processes of each launch")
    add("--model", default=str(TINY_MODEL), help="the model both sides train (default: the bundled tiny Llama)")
    add("--dataset", default=None, help="instruction or prompt/completion data (default: the bundled data/)")
    add("--mixed-precision", choices=("no", "bf16"), default="no",
        help="the launcher's --mixed_precision; bf16 needs GPUs (both sides then load the base in bf16)")
    add("--liger", action="store_true",
        help="each side with Liger (GPU, liger-kernel): the recipe's --liger (its layers' kernels, its own chunked "
             "loss) against SFTTrainer's use_liger_kernel (the same kernels and Liger's fused linear cross-entropy)")
    add("--seed", type=int, default=42)
    add("--output-dir", default="outputs/compare_trl", help="where each run and summary.json go")
    add("--timeout", type=int, default=600, help="seconds one launch may take")
    args = parser.parse_args(argv)
    if args.steps < 2 or min(args.batch_size, args.grad_accum, args.rounds, args.processes) < 1:
        parser.error("--steps must be at least 2 (step 1 is not timed); the other counts at least 1")
    return args


def ensure_tiny_model() -> None:
    """Build the bundled model once, before the launches (both sides load it from models/tiny-llama)."""
    if not (TINY_MODEL / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "build_tiny_model.py"), "--output-dir",
                        str(TINY_MODEL)], check=True, cwd=REPO)


def threads_per_process(processes: int) -> int:
    """What recipes/common/runtime.share_cpu_cores gives each process."""
    return max(1, (os.cpu_count() or 1) // processes)


def launch_command(side: str, output_dir: Path, args, port: int) -> list[str]:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(DDP_CONFIG),
               "--num_processes", str(args.processes), "--mixed_precision", args.mixed_precision]
    if args.processes > 1:
        command += ["--main_process_port", str(port)]
    command += [str(SIDES[side][1]), "--output-dir", str(output_dir), "--model", args.model,
                *(["--dataset", args.dataset] if args.dataset else []), "--max-steps", str(args.steps),
                "--batch-size", str(args.batch_size), "--grad-accum", str(args.grad_accum),
                "--max-length", str(args.max_length), "--seed", str(args.seed), *(["--liger"] if args.liger else [])]
    if side == "ours":  # no tracker, no progress lines, evaluation only after the last (timed) step
        command += ["--report-to", "none", "--log-every", "0", "--eval-every", "0", "--no-eval-on-start"]
    return command


def launch_env(processes: int) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads_per_process(processes))}


def timed_part(records: list[dict]) -> dict:
    """tokens/s of steps 2..N from metrics.jsonl's train lines (step, tokens, elapsed_s)."""
    steady = steady_state(records, warmup_steps=0)
    steps = sorted((r for r in records if r.get("type") == "train"), key=lambda r: r["step"])
    return {
        "steps": steady["steps"],
        "timed_s": steady["steady_s"],
        "timed_tokens": steady["steady_tokens"],
        "tokens_per_s": steady["tokens_per_s"],
        "step_tokens": [r["tokens"] for r in steps],
        "mean_loss": statistics.fmean(r["loss"] for r in steps) if all("loss" in r for r in steps) else None,
    }


def cpu_busy_fraction(seconds: float = 1.0) -> float | None:
    """How busy the CPU is right now (all cores, 0..1), from /proc/stat; None where there is none.
    Sampled between launches, it is other people's work competing with the next run."""
    def sample():
        with open("/proc/stat") as stat:
            values = [int(v) for v in stat.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    try:
        total_before, idle_before = sample()
        time.sleep(seconds)
        total_after, idle_after = sample()
    except OSError:
        return None
    total = total_after - total_before
    return 1 - (idle_after - idle_before) / total if total > 0 else None


def stderr_tail(path: Path, lines: int = 12) -> list[str]:
    """The last lines the ranks wrote to stderr, before torch's launcher adds its own report of the exit."""
    progress_bar = re.compile(r"\d+%\|")
    text = [line for line in path.read_text(errors="replace").splitlines()
            if line.strip() and not progress_bar.search(line)] if path.exists() else []
    launcher_report = next((i for i, line in enumerate(text) if "elastic/multiprocessing/api.py" in line), len(text))
    return text[:launcher_report][-lines:] or text[-lines:]


def failure_cause(lines: list[str]) -> str:
    """A recipe's refusal (`error: ...`), else the exception a rank raised, else the last line."""
    refusal = next((line for line in lines if line.startswith("error: ")), None)
    if refusal:
        return refusal[len("error: "):]
    exception = re.compile(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception|Exit)\b.*")
    raised = [line for line in lines if exception.match(line)]
    return (raised or lines or ["no output on stderr"])[-1]


def launched(command: list[str], output_dir: Path, label: str, processes: int, timeout: int) -> dict:
    """Run one launch whose program writes metrics.jsonl to `output_dir` (emptied first): its records, the seconds
    from the launch to its end (what the user waits for: start-up, loading, tokenising, the loop, saving), when each
    line of its stdout came (seconds since the launch), and how busy the CPU was just before. A launch that fails
    raises LaunchFailed, named by `label`."""
    if output_dir.exists():
        shutil.rmtree(output_dir)  # a fresh run: no stale metrics
    output_dir.mkdir(parents=True)
    busy = cpu_busy_fraction()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    lines = []  # (seconds since the launch, line)
    started = time.monotonic()
    with open(output_dir / "stdout.log", "w") as stdout, open(output_dir / "stderr.log", "w") as stderr:
        process = subprocess.Popen(command, cwd=REPO, env=launch_env(processes), stdout=subprocess.PIPE, stderr=stderr,
                                   text=True, errors="replace")

        def read():
            for line in process.stdout:
                lines.append((round(time.monotonic() - started, 3), line.rstrip("\n")))
                stdout.write(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            code = process.wait(timeout=timeout)
            failure = f"exit status {code}" if code != 0 else None
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            failure = f"no end after {timeout} s"
        end_to_end = time.monotonic() - started
        reader.join(timeout=10)
    metrics = output_dir / "metrics.jsonl"
    if failure is None and not metrics.exists():
        failure = "no metrics.jsonl written"
    if failure is not None:
        tail = stderr_tail(output_dir / "stderr.log")
        raise LaunchFailed(tail, f"{label} failed ({failure}): {failure_cause(tail)}; logs in {output_dir}")
    return {"records": [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()],
            "end_to_end_s": round(end_to_end, 3), "stdout_lines": lines, "cpu_busy_before": busy,
            "load_1min_before": load}


def run_side(side: str, round_number: int, args) -> dict:
    output_dir = Path(args.output_dir).resolve() / f"round{round_number}-{side}"
    done = launched(launch_command(side, output_dir, args, free_port()), output_dir,
                    f"the {SIDES[side][0]} launch of round {round_number}", args.processes, args.timeout)
    run = {"round": round_number, "side": side, "output_dir": str(output_dir), "cpu_busy_before": done["cpu_busy_before"],
           "end_to_end_s": done["end_to_end_s"], **timed_part(done["records"])}
    if side == "trl":
        trl_run = json.loads((output_dir / "trl_run.json").read_text())
        run.update(mean_loss=trl_run.get("train_loss"), torch_threads=trl_run.get("torch_threads"),
                   global_token_mean_loss=trl_run["model_accepts_loss_kwargs"]
                   and trl_run["average_tokens_across_devices"])
    return run


def run_line(run: dict) -> str:
    return (f"round {run['round']}  {SIDES[run['side']][0]:<4}  {run['tokens_per_s']:9.1f} tokens/s  "
            f"{run['steps']} steps  timed {run['timed_s']:.3f} s (steps 2-{run['steps']}, "
            f"{run['timed_tokens']} target tokens)")


def spread(values: list[float]) -> float:
    """(max - min) / median, as a fraction."""
    return (max(values) - min(values)) / statistics.median(values)


def verdict(ratio: float) -> str:
    """What the measured ratio (ours / TRL tokens per second) says, at this overhead-bound size."""
    if ratio >= 1.1:
        return ("the gap is likely TRL/Trainer's fixed per-micro-batch bookkeeping (metric all-gathers, FLOP "
                "counting, model.train(); not profiled by this script), which a compute-bound model on GPUs "
                "would shrink")
    if ratio <= 1 / 1.1:
        return f"TRL is {1 / ratio:.2f}x faster here: look at the recipe's per-step work before trusting it elsewhere"
    return "the two are within 10% of each other, no difference worth reporting at this size"


def main(argv=None) -> int:
    args = parse_args(argv)
    if Path(args.model) == TINY_MODEL:
        ensure_tiny_model()
    model = "bundled tiny Llama" if Path(args.model) == TINY_MODEL else args.model
    print(f"workload: {model} + LoRA, {args.dataset or 'data/train.jsonl'}, {args.steps} steps of {args.processes} "
          f"processes x batch {args.batch_size} x grad-accum {args.grad_accum}, max-length {args.max_length}, "
          f"{'fp32' if args.mixed_precision == 'no' else args.mixed_precision}, {os.cpu_count()} CPU cores, "
          f"{threads_per_process(args.processes)} torch thread(s) per process", flush=True)
    runs = []
    try:
        for round_number in range(1, args.rounds + 1):
            order = ("ours", "trl") if round_number % 2 else ("trl", "ours")
            for side in order:
                runs.append(run_side(side, round_number, args))
                print(run_line(runs[-1]), flush=True)
    except LaunchFailed as failure:
        tail, message = failure.args
        print("\n".join(f"  | {line}" for line in tail), file=sys.stderr)
        print(f"error: {message}", file=sys.stderr)
        return 1

    by_side = {side: [run for run in runs if run["side"] == side] for side in SIDES}
    # Every run of both sides must have trained on the same target tokens, step by step.
    reference = by_side["ours"][0]["step_tokens"]
    differing = [run for run in runs if run["step_tokens"] != reference]
    ours_tokens, trl_tokens = by_side["ours"][0]["timed_tokens"], by_side["trl"][0]["timed_tokens"]
    print(f"target tokens per run (steps 2-{args.steps}): ours {ours_tokens}, TRL {trl_tokens}"
          + (" (the same in every step of every run)" if not differing else ""))
    if differing:
        print(f"error: {len(differing)} run(s) trained on other target tokens than round 1 of ours "
              f"(first: round {differing[0]['round']} {differing[0]['side']}); the comparison is void", file=sys.stderr)
        return 1

    losses = {side: statistics.fmean(run["mean_loss"] for run in by_side[side]) for side in SIDES}
    print(f"mean training loss: ours {losses['ours']:.4f}, TRL {losses['trl']:.4f}"
          + ("" if all(run["global_token_mean_loss"] for run in by_side["trl"])
             else " (TRL averaged per micro-batch, not over the global batch)"))
    medians = {side: statistics.median(run["tokens_per_s"] for run in by_side[side]) for side in SIDES}
    spreads = {side: spread([run["tokens_per_s"] for run in by_side[side]]) for side in SIDES}
    step_ms = {side: 1000 * statistics.median(run["timed_s"] / (run["steps"] - 1) for run in by_side[side])
               for side in SIDES}
    trl_threads = by_side["trl"][0]["torch_threads"]
    print(f"median tokens/s: ours {medians['ours']:.1f}, TRL {medians['trl']:.1f} "
          f"(spread over {args.rounds} round(s): ours {spreads['ours']:.0%}, TRL {spreads['trl']:.0%}; "
          f"torch threads per process: ours {threads_per_process(args.processes)}, TRL {trl_threads})")
    busy = [run["cpu_busy_before"] for run in runs if run["cpu_busy_before"] is not None]
    ratio = medians["ours"] / medians["trl"]
    print(f"limits: a 2-layer, 64-wide model and ~{statistics.fmean(reference):.0f} target tokens per step on "
          f"{os.cpu_count()} CPU cores: a step ({step_ms['ours']:.0f} ms ours, {step_ms['trl']:.0f} ms TRL) is "
          f"per-op and per-step overhead, not arithmetic; {verdict(ratio)}"
          + (f"; other processes kept the CPU {statistics.median(busy):.0%} busy before a run (median; "
             f"max {max(busy):.0%})" if busy else ""))
    end_to_end = {side: statistics.median(run["end_to_end_s"] for run in by_side[side]) for side in SIDES}
    print(f"median end to end (launch to adapter saved): ours {end_to_end['ours']:.1f} s, TRL "
          f"{end_to_end['trl']:.1f} s (x{end_to_end['trl'] / end_to_end['ours']:.2f})")
    summary = {"arguments": vars(args), "runs": runs, "median_tokens_per_s": medians, "spread": spreads,
               "mean_loss": losses, "ratio": ratio, "median_end_to_end_s": end_to_end,
               "end_to_end_ratio": end_to_end["trl"] / end_to_end["ours"]}
    (Path(args.output_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"ratio: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
