"""Score a finished run (its model/, merged/, or adapter/ on its base model), or any model, on lm-evaluation-harness
tasks, every process of the launch scoring its share.

    python scripts/evaluate.py outputs/quickstart --tasks data/eval_tasks
    accelerate launch --config_file accelerate_configs/fsdp.yaml scripts/evaluate.py outputs/run --tasks arc_easy,hellaswag
    accelerate launch --config_file accelerate_configs/ddp.yaml scripts/evaluate.py meta-llama/Llama-3.2-1B --tasks arc_easy

The same scoring as a recipe's --eval-tasks (recipes/common/training/benchmarks.py: lm-eval's own HFLM, each
data-parallel rank its share of the requests), on the model loaded from its files: an adapter stays unmerged on
its base (quantized as its run trained it). A run that trained on chat rows is scored through its chat template
and system prompt, as it trained (--raw-prompts: the tasks' raw text); a model without run.json on raw text.
--tasks takes task or group names, task YAMLs or folders of them; their data must be on the machine (checked
offline before the model loads). Prints a table; writes the scores to --output (default: benchmarks.json in a
run's folder). Launches: one process, DDP, FSDP, DeepSpeed (not model, tensor, pipeline or sequence parallel); each
process loads the whole model before the launch places or shards it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "recipes"))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import common.quiet  # noqa: E402,F401  (first: the recipes' filter of library notices)
from common.outputs.script_flags import evaluate_flags  # noqa: E402  (no torch)


if __name__ == "__main__":  # --help and a mistyped flag answered before torch loads
    evaluate_flags(__doc__).parse_args()


import torch  # noqa: E402

from common.launching import eval_tasks  # noqa: E402
from common.launching.launch import DEEPSPEED, FSDP, MODEL_PARALLEL, describe  # noqa: E402
from common.refusal import refuse  # noqa: E402
from common.training.benchmarks import Prompts, run_prompts, score  # noqa: E402
from common.training.runtime import scoring_accelerator  # noqa: E402
from generate import find_model, load, load_tokenizer  # noqa: E402  (how generate.py finds and loads a model)


def main(argv=None) -> None:
    args = evaluate_flags(__doc__).parse_args(argv)
    launch = describe()
    tasks = eval_tasks.check(SimpleNamespace(eval_tasks=args.tasks, eval_limit=args.limit), launch)
    if launch.kind == MODEL_PARALLEL:
        refuse("scripts/evaluate.py loads the model whole on each process: launch it with ddp.yaml, fsdp.yaml or a "
               "DeepSpeed config (the recipes' --eval-tasks scores under model parallel)")
    if args.batch_size < 1:
        refuse(f"--batch-size {args.batch_size}: give 1 or more")
    try:
        run, model = find_model(args.model, args.artifact)
    except ValueError as problem:
        refuse(str(problem))
    accelerator = scoring_accelerator(launch, args.batch_size)
    bits = run and run["arguments"].get("bits")
    # on the CPU, for the launch to place or shard; a quantized base loads where it computes (bitsandbytes)
    loaded = load(model, run, str(accelerator.device) if bits else "cpu")
    tokenizer = load_tokenizer(model)
    if launch.kind == FSDP:  # accelerate shards a model under FSDP2 only beside an optimizer: one that never steps
        prepared, _ = accelerator.prepare(loaded, torch.optim.SGD(loaded.parameters(), lr=0.0))
    elif launch.kind == DEEPSPEED:
        prepared = accelerator.prepare(loaded)
    else:  # one process, DDP: each rank its whole copy, nothing to keep in step without gradients
        prepared = loaded if bits else loaded.to(accelerator.device)
    # as the run trained (its rows' format and system prompt in run.json); a model of no run: raw, as lm_eval's default
    prompts = run_prompts(run["data_format"], run.get("system_prompt"), args.raw_prompts) if run else Prompts(False)
    scores = score(accelerator, launch, prepared, tokenizer, tasks, args.limit, args.batch_size, None, prompts)
    if accelerator.is_main_process:
        print(f"prompts: {prompts.describe()}")
        for task, metrics in scores.items():
            for metric, value in metrics.items():
                print(f"{task}\t{metric}\t{value:.4f}")
        in_run = Path(args.model, "run.json").is_file()  # a run's folder, not a model inside one
        output = args.output or (str(Path(args.model) / "benchmarks.json") if in_run else None)
        if output:
            Path(output).write_text(json.dumps({"model": model, "tasks": list(tasks.names), "limit": args.limit,
                                                "processes": accelerator.num_processes, "prompts": prompts.describe(),
                                                "scores": scores}, indent=2) + "\n")
            print(f"scores written to {output}")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
