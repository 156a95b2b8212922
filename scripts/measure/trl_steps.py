"""What the TRL workers here (trl_dpo_worker.py, trl_kto_worker.py, trl_reward_worker.py, trl_grpo_worker.py) write:
one metrics.jsonl line per optimizer step, with TRL's logged names and the seconds since the trainer was set up."""

from __future__ import annotations

import json
import time
from pathlib import Path


def step_recorder(logged: tuple[str, ...]):
    """A TrainerCallback that keeps, at each step TRL logs, the figures named in `logged` (those it logged), the
    step and `elapsed_s`; its `write(output_dir)` writes them to metrics.jsonl."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.records, self.started = [], time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.records.append({"type": "train", "step": state.global_step,
                                     **{name: logs[name] for name in logged if name in logs},
                                     "elapsed_s": round(time.perf_counter() - self.started, 3)})

        def write(self, output_dir) -> None:
            (Path(output_dir) / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in self.records))

    return Recorder()
