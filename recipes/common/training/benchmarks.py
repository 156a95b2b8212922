"""Benchmarks of the model where the launch holds it: lm-evaluation-harness tasks (--eval-tasks), scored by
lm-eval's own request code (its `HFLM`) on the trained model as it is, sharded or not, LoRA unmerged.

lm-eval's evaluator splits a task's requests by rank and pads every rank to the same count; each
data-parallel rank scores its share in batches and the per-row results meet on the main process, as under
`accelerate launch -m lm_eval`, so N ranks score about N times as fast as one. Under FSDP and ZeRO-3 every
forward gathers shards from all ranks: each rank runs the same number of forwards (no logits cache, which
would let a rank skip some) and generation steps until every rank is done (`synced_gpus`).

A run that trained on chat rows (or chat pairs) is scored as it trained: each request through the chat template
the run trained with, after the system turn every row opened with (lm-eval's `--apply_chat_template` and
`--system_instruction`); other runs, or `--eval-raw-prompts`, on the task's text as it is.
"""

from __future__ import annotations

import contextlib
import io
import logging
import random
import time
from dataclasses import dataclass

import numpy
import torch
from torch.distributed.fsdp import FSDPModule

from ..data.formats import shortened
from ..data.pairs import renders_chat
from ..launching.eval_tasks import EvalTasks, parse


@dataclass(frozen=True)
class Prompts:
    """How the requests reach the model: through its chat template (after `system`, where given), or raw."""
    chat: bool
    system: str | None = None

    def describe(self) -> str:
        if not self.chat:
            return "raw prompts"
        return "chat template" + (f", system prompt {shortened(self.system, 80)!r}" if self.system else "")


def run_prompts(data_format: str, system: str | None, raw: bool) -> Prompts:
    """As the run trained (`data_format`, the `system` prompt its rows opened with), unless `raw`."""
    chat = renders_chat(data_format) and not raw
    return Prompts(chat, system if chat else None)


def launch_lm(accelerator, launch, model, tokenizer, batch_size: int, max_length: int):
    """lm-eval's HFLM over the launch's model, ranked as the launch's data-parallel ranks."""
    from lm_eval.models.huggingface import HFLM

    class LaunchLM(HFLM):
        def __init__(self):
            super().__init__(pretrained=accelerator.unwrap_model(model), tokenizer=tokenizer, backend="causal",
                             batch_size=batch_size, max_length=max_length, logits_cache=False)
            self.accelerator = accelerator
            self._device = accelerator.device
            self._rank, self._world_size = accelerator.process_index, accelerator.num_processes

        @property
        def model(self):  # as the launch holds it (HFLM would unwrap it again through the accelerator)
            return self._model

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            # a PeftModel's generate calls the inner model's forward, past the FSDP2 root's hooks that gather
            # the root's own weights (embeddings, final norm, head): gathered here for the whole generation
            root = self._model if isinstance(self._model, FSDPModule) else None
            if root is not None:
                self._model(input_ids=context[:, :1])  # through the root once: FSDP2's set-up runs on a forward
                root.unshard()
            try:
                return super()._model_generate(context, max_length, stop, synced_gpus=launch.shards_parameters,
                                               **generation_kwargs)
            finally:
                if root is not None:
                    root.reshard()

    return LaunchLM()


@torch.no_grad()
def score(accelerator, launch, model, tokenizer, tasks: EvalTasks, limit: int | None, batch_size: int,
          max_length: int, prompts: Prompts) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} on every rank, the metrics named as lm-eval prints them ("acc", "acc_norm",
    "exact_match", a filter's name after a comma when it is not lm-eval's "none"). Random states are
    restored after: lm-eval seeds Python's, NumPy's and torch's generators, and training may go on."""
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    # lm-eval's notices (a model object means one process, a task's metadata) say nothing a user can act on here
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    states = random.getstate(), numpy.random.get_state(), torch.get_rng_state()
    devices = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    lm = launch_lm(accelerator, launch, model, tokenizer, batch_size, max_length)
    manager = TaskManager(include_path=list(tasks.include_path) or None)
    was_training = model.training
    model.eval()
    # Eager even under --compile (every request length would be another graph), in the run's mixed precision;
    # lm-eval's progress bars and notices left out, one line instead (an error still ends the run with its traceback).
    if accelerator.is_main_process:
        print(f"benchmarks: scoring {', '.join(tasks.names)} with lm-eval", flush=True)
    with torch.compiler.set_stance("force_eager"), accelerator.autocast(), contextlib.redirect_stderr(io.StringIO()):
        results = evaluator.simple_evaluate(model=lm, tasks=list(tasks.names), task_manager=manager, limit=limit,
                                            bootstrap_iters=0, log_samples=False, apply_chat_template=prompts.chat,
                                            system_instruction=prompts.system)
    model.train(was_training)
    random.setstate(states[0])
    numpy.random.set_state(states[1])
    torch.set_rng_state(states[2])
    if devices is not None:
        torch.cuda.set_rng_state_all(devices)
    scores = [scores_of(results) if results is not None else None]  # the main process's (lm-eval returns None elsewhere)
    if accelerator.num_processes > 1:
        torch.distributed.broadcast_object_list(scores, src=0)
    return scores[0]


def scores_of(results: dict) -> dict[str, dict[str, float]]:
    """lm-eval's results, each task's numeric metrics (no stderr, no alias)."""
    scores = {}
    for task, values in results["results"].items():
        metrics = {}
        for key, value in values.items():
            metric, _, kind = key.partition(",")
            if not kind or "_stderr" in metric or not isinstance(value, (int, float)):
                continue
            metrics[metric if kind == "none" else f"{metric},{kind}"] = float(value)
        scores[task] = metrics
    return scores


def score_run(accelerator, launch, run, model, tokenizer, data_format) -> dict:
    """The run's --eval-tasks (checked at start-up) with --eval-limit rows each, in batches of the training
    micro-batch, each request's context as long as the model takes (lm-eval's own rule), prompted as the run
    trained (`data_format`: the rows' format and system prompt; --eval-raw-prompts: raw): {"seconds": the
    scoring's wall time, "scores": {task: {metric: value}}, "prompts": how they were asked}."""
    started = time.monotonic()
    prompts = run_prompts(data_format, data_format.system_prompt, run.eval_raw_prompts)
    scores = score(accelerator, launch, model, tokenizer, parse(run.eval_tasks), run.eval_limit, run.batch_size, None,
                   prompts)
    return {"seconds": round(time.monotonic() - started, 2), "scores": scores, "prompts": prompts.describe()}
