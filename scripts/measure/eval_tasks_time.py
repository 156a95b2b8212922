"""--eval-tasks' scoring inside the launch against lm-eval's own command on the merged model: time and scores.

    python scripts/measure/eval_tasks_time.py --out results/<date>_cpu_eval-tasks-time
    python scripts/measure/eval_tasks_time.py --out DIR --config fsdp --processes 2 --tasks data/eval_tasks --rounds 3

Each round trains recipes/lora.py for --steps steps on the bundled model and rows with --eval-tasks and --merge
under --config with --processes CPU processes (fp32), and reads the scoring's wall time from metrics.jsonl
(the `benchmarks` line's `seconds`: the scoring alone, the model already in memory); then runs
`lm_eval run --model hf` on merged/ in one process at the same batch size and reads its
`total_evaluation_time_seconds` (lm-eval's own figure, its model load included) and the command's wall time.
Medians over the rounds; the scores of both sides beside. Writes results.json and results.md to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default="ddp", help="accelerate_configs/<config>.yaml (default: ddp)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--tasks", default="data/eval_tasks", help="--eval-tasks (default: the bundled two)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args(argv)


def environment() -> dict:
    import os

    return {**os.environ, **OFFLINE, "PYTHONUNBUFFERED": "1"}


def in_launch(args, output: Path) -> dict:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "accelerate_configs" / f"{args.config}.yaml"), "--num_processes", str(args.processes),
               "--mixed_precision", "no", str(REPO / "recipes" / "lora.py"), "--max-steps", str(args.steps),
               "--lr", "3e-3", "--batch-size", str(args.batch_size), "--max-length", "64", "--eval-tasks", args.tasks,
               "--merge", "--output-dir", str(output), "--report-to", "none"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=environment())
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    lines = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    [scored] = [line for line in lines if line["type"] == "benchmarks"]
    return {"seconds": scored["seconds"],
            "scores": {key: value for key, value in scored.items() if key not in ("type", "step", "seconds")}}


def lm_eval_command(args, model: Path, names: list[str], include: list[str], output: Path) -> dict:
    sys.path.insert(0, str(REPO / "recipes"))
    from common.training.benchmarks import scores_of

    command = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={model},dtype=float32",
               "--tasks", ",".join(names), "--batch_size", str(args.batch_size), "--device", "cpu",
               "--output_path", str(output), *(["--include_path", *include] if include else [])]
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=environment())
    wall = time.monotonic() - started
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    [written] = sorted(output.rglob("results_*.json"))[-1:]
    results = json.loads(written.read_text())
    return {"seconds": float(results["total_evaluation_time_seconds"]), "wall_seconds": round(wall, 2),
            "scores": scores_of(results)}


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO / "recipes"))
    from common.launching.eval_tasks import parse

    tasks = parse(args.tasks)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path("/tmp/eval-tasks-time")
    rounds = []
    for index in range(args.rounds):
        folder = scratch / f"round-{index}"
        subprocess.run(["rm", "-rf", str(folder)], check=True)
        ours = in_launch(args, folder / "run")
        theirs = lm_eval_command(args, folder / "run" / "merged", list(tasks.names), list(tasks.include_path),
                                 folder / "lm_eval")
        rounds.append({"in_launch": ours, "lm_eval": theirs})
        print(f"round {index + 1}: in the launch {ours['seconds']:.1f} s, lm_eval {theirs['seconds']:.1f} s "
              f"(wall {theirs['wall_seconds']:.1f} s); same scores: {ours['scores'] == theirs['scores']}", flush=True)
    median = {"in_launch_seconds": statistics.median(r["in_launch"]["seconds"] for r in rounds),
              "lm_eval_seconds": statistics.median(r["lm_eval"]["seconds"] for r in rounds),
              "lm_eval_wall_seconds": statistics.median(r["lm_eval"]["wall_seconds"] for r in rounds)}
    record = {"command": " ".join(["python", "scripts/measure/eval_tasks_time.py", *(argv or sys.argv[1:])]),
              "config": args.config, "processes": args.processes, "tasks": list(tasks.names),
              "batch_size": args.batch_size, "rounds": rounds, "median": median,
              "same_scores": all(r["in_launch"]["scores"] == r["lm_eval"]["scores"] for r in rounds)}
    (out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "results.md").write_text(
        f"# --eval-tasks inside the launch vs lm-eval's command ({args.config}, {args.processes} CPU processes)\n\n"
        f"`{record['command']}`\n\n| side | seconds (median of {args.rounds}) |\n|---|---:|\n"
        f"| in the launch, {args.processes} processes (the scoring alone) | {median['in_launch_seconds']:.1f} |\n"
        f"| `lm_eval run --model hf` on merged/, 1 process (its total_evaluation_time_seconds: from its start, "
        f"the model's load included) | "
        f"{median['lm_eval_seconds']:.1f} |\n| the same command's wall time | {median['lm_eval_wall_seconds']:.1f} |\n\n"
        f"Same scores in every round: {record['same_scores']}; last round's: "
        f"`{json.dumps(rounds[-1]['in_launch']['scores'])}`\n")
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
