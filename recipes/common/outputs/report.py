"""What a finished run shows a person: sample generations and a model card (README.md)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..data.formats import IGNORE, shortened
from ..data.images import prompt_inputs
from ..launching.args import FEEDBACK_RECIPES, ONLINE_RECIPES, PREFERENCE_RECIPES, REWARD_RECIPES
from ..model import adapters


@torch.no_grad()
def sample_generations(accelerator, launch, model, stages, tokenizer, eval_set, output_dir, count: int = 3,
                       max_new_tokens: int = 32, processor=None) -> list[dict]:
    """Greedy answers of the trained model to the first evaluation prompts; printed and saved
    to samples.jsonl. Every rank generates (sharded weights need every rank's forward; under pipeline
    parallel, the first pipeline's `stages`). A vision-language model's `processor` gives a row's images
    with its prompt; the line names them after the prompt, whose placeholders show where they stand."""
    if stages and stages.layout.replica:  # the other pipelines hold the same weights
        return []
    generator = accelerator.unwrap_model(model)
    generator.eval()
    # Eager even under --compile: each new KV-cache length and layer index would be another graph,
    # compiled for a few tokens until torch gives up at its recompile limit with a page of warnings.
    # Under the run's mixed precision, as training ran (the adapters take their inputs in its 16 bits).
    with torch.compiler.set_stance("force_eager"), accelerator.autocast():
        samples = [generate_one(accelerator, generator, tokenizer, row, max_new_tokens, launch.shards_parameters,
                                stages, processor) for row in eval_set.select(range(min(count, len(eval_set))))]
    generator.train()
    if accelerator.is_main_process:
        with open(Path(output_dir) / "samples.jsonl", "w") as file:
            for sample in samples:
                file.write(json.dumps(sample) + "\n")
        for sample in samples:  # (samples.jsonl holds them whole; a console line a few hundred characters)
            shown = f" [images: {', '.join(Path(path).name for path in sample['images'])}]" if sample.get("images") else ""
            print(f"sample: {shortened(sample['prompt'])!r}{shown} -> {shortened(sample['generated'])!r} "
                  f"(reference {shortened(sample['reference'])!r})")
    return samples


def generate_one(accelerator, generator, tokenizer, row, max_new_tokens: int, sharded: bool, stages=None,
                 processor=None) -> dict:
    """The greedy answer to one evaluation row's prompt (the tokens before its first target token; with a
    vision-language model's `processor`, the row's images with it, their placeholders expanded)."""
    prompt_length = next((i for i, label in enumerate(row["labels"]) if label != IGNORE), len(row["labels"]))
    prompt = torch.tensor([row["input_ids"][:prompt_length]], device=accelerator.device)
    if processor is not None:
        files = row.get("images") or []
        inputs = prompt_inputs(processor, tokenizer.decode(prompt[0]), files).to(accelerator.device)
        expanded = inputs["input_ids"].shape[1]
        output = generator.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id, synced_gpus=sharded)
        reference = [t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE]
        return {"prompt": tokenizer.decode(prompt[0]), "images": files,
                "reference": tokenizer.decode(reference, skip_special_tokens=True),
                "generated": tokenizer.decode(output[0, expanded:], skip_special_tokens=True)}
    if stages:  # through the stages, token by token
        stop = generator.generation_config.eos_token_id
        output = stages.generate(prompt, max_new_tokens, stop if isinstance(stop, list) else [stop])
    else:
        output = generator.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=tokenizer.pad_token_id,
            synced_gpus=sharded,  # every rank's forward gathers the shards: they keep stepping until all finish
        )
    reference = [t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE]
    return {
        # the prompt as the model saw it, its template's markers included (a chat row's roles and turns)
        "prompt": tokenizer.decode(prompt[0]),
        "reference": tokenizer.decode(reference, skip_special_tokens=True),
        "generated": tokenizer.decode(output[0, prompt_length:], skip_special_tokens=True),
    }


def write_model_card(accelerator, args, recipe: str, artifact: str, samples: list[dict]) -> None:
    """README.md in the output folder: what was trained, on what, how well, and how to load it."""
    if not accelerator.is_main_process:
        return
    output_dir = Path(args.output_dir)
    run = json.loads((output_dir / "run.json").read_text())
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if line["type"] == "train"]
    evals = [line for line in lines if line["type"] == "eval"]
    base = run["base_model"]
    if artifact == "adapter":  # the base the saved adapter names: its own, never a cache (checkpoint.save_adapter)
        base = adapters.adapter_base(str(output_dir / "adapter")) or base
    load = {
        "model": f'AutoModelForCausalLM.from_pretrained("{output_dir / "model"}")',
        "adapter": f'PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base}"), "{output_dir / "adapter"}")',
        # a reward model (reward.py: merged/, reward_full.py: model/): one score a row
        "merged": f'AutoModelForSequenceClassification.from_pretrained("{output_dir / "merged"}")',
    }[artifact]
    loader = "AutoModelForSequenceClassification" if recipe in REWARD_RECIPES else "AutoModelForCausalLM"
    load = load.replace("AutoModelForCausalLM", loader)
    bundled = ("bundled data/preferences/" if recipe in (*PREFERENCE_RECIPES, *FEEDBACK_RECIPES, *REWARD_RECIPES) else "bundled data/prompts/"
               if recipe in ONLINE_RECIPES else "bundled data/")  # the default --dataset
    start = run.get("start_adapter")
    origin = (f", started from the LoRA adapter `{start}` merged onto it" if start else
              f" ({args.settled_from['model']})" if "model" in args.settled_from else "")
    program = run.get("program") or {"path": f"{recipe}.py", "sha256": None, "git": None}
    git = program["git"]
    card = [
        f"# {Path(run['base_model']).name} fine-tuned with {Path(program['path']).name}",
        "",
        f"- program: `{program['path']}`" + (f" (sha256 {program['sha256'][:12]}" if program["sha256"] else "")
        + (f"; git {git['commit'][:12]}, the program {git['program']}{', the tree changed' if git['dirty'] else ''})"
           if git else ")" if program["sha256"] else ""),
        f"- base model: `{run['base_model']}`{origin}",
        f"- data: {', '.join(f'`{spec}`' for spec in args.dataset or [bundled])} "
        f"({run['data_format']} format{', packed' if args.packing else ''})",
        f"- strategy: {run['distributed_type']} x {run['num_processes']} process(es) ({run['launch']['name']}), "
        f"{'fp32' if run['mixed_precision'] == 'no' else run['mixed_precision']} precision",
        f"- steps: {len(train)}, micro-batch {args.batch_size} x accumulation {args.grad_accum}, lr {args.lr}, "
        f"max length {args.max_length}, seed {args.seed}",
        f"- parameters: {run['parameters']['total']:,} ({run['parameters']['trainable']:,} trained)",
    ]
    if train and "reward" in train[0]:  # an online run: its reward says how it went (its loss stays near 0)
        card.append(f"- rewards: {', '.join(args.reward)}; reward {train[0]['reward']:.4f} at the first step, "
                    f"{train[-1]['reward']:.4f} at the last")
    elif train:
        card.append(f"- training loss: {train[0]['loss']:.4f} at the first step, {train[-1]['loss']:.4f} at the last")
    if evals:
        shown = [key for key in evals[-1] if key not in ("type", "step")]
        card.append("- evaluation: " + ", ".join(f"{key} {evals[-1][key]:.4f}" for key in shown)
                    + (f" (before training: {', '.join(f'{key} {evals[0][key]:.4f}' for key in shown if key in evals[0])})"
                       if len(evals) > 1 and evals[0]["step"] == 0 else ""))
    benchmarks = [line for line in lines if line["type"] == "benchmarks"]
    if benchmarks:  # --eval-tasks: lm-evaluation-harness's scores at the last step they were taken
        scored = benchmarks[-1]
        card += ["", f"## Benchmarks (lm-evaluation-harness, step {scored['step']})", "", "| task | metric | value |",
                 "|---|---|---:|"]
        card += [f"| {task} | {metric} | {value:.4f} |" for task, metrics in scored.items()
                 if isinstance(metrics, dict) for metric, value in metrics.items()]
    card += ["", "## Load it", "", "```python", f"from transformers import {loader}",
             *(["from peft import PeftModel"] if artifact == "adapter" else []), f"model = {load}", "```"]
    if samples:
        card += ["", "## Samples (greedy, evaluation prompts)", ""]
        card += [f"- `{s['prompt']!r}` -> `{s['generated']!r}` (reference `{s['reference']!r}`)" for s in samples]
    written = [name for name in ("samples.jsonl", "checkpoints/") if (output_dir / name.rstrip("/")).exists()]
    card += ["", "Files: run.json (what ran), metrics.jsonl (per step)" + "".join(f", {name}" for name in written) + "."]
    (output_dir / "README.md").write_text("\n".join(card) + "\n")
