#!/usr/bin/env python
"""The TRL side of scripts/measure/compare_trl.py: recipes/lora.py's workload, trained by TRL's SFTTrainer.

compare_trl.py launches it exactly as it launches the recipe, with the same flags:

    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 --mixed_precision no \\
        scripts/measure/trl_sft_worker.py --output-dir outputs/compare_trl/round1-trl --max-steps 120 --grad-accum 2

It parses the recipe's own flags (recipes/common/launching/args.py), so every default (lr, warm-up, clipping,
LoRA r / alpha / dropout / targets, seed, --max-length) is the recipe's, and sets SFTTrainer up to do
what recipes/lora.py does:

- tokens: the rows the recipe trains on, rendered by the recipe's formats.py into a prompt/completion
  dataset (prompt = BOS + the rendered instruction, completion = the response; TRL appends EOS and
  trains on the completion only). After TRL has tokenised it, every row is checked to be the recipe's
  input_ids and labels token for token; the run stops otherwise.
- order: the recipe shuffles with accelerate's seedable sampler (seed + epoch). The rows are put in
  that order here and read sequentially, so every rank gets the recipe's micro-batches.
- training: torch's fused AdamW (TRL's default; the update is AdamW's, fused or not), the recipe's lr,
  int(warmup_ratio x steps) warm-up steps, cosine decay, max_grad_norm, weight decay, seed; fp32,
  or bf16 autocast over a bf16 base when launched with --mixed_precision bf16; activation
  checkpointing only with --gradient-checkpointing (TRL turns it on by default, the recipe leaves
  it off); find_unused_parameters off (Trainer turns it on for PEFT models, the recipe does not,
  and every adapter gets a gradient); --attention when given; batches collated in the main
  process (the counting needs it; the recipe's default on CPU too); no evaluation, no checkpoints, no
  reporting. --liger turns on SFTTrainer's use_liger_kernel (Liger's layer kernels and its fused linear
  cross-entropy: TRL's fastest switch; the recipe's --liger patches the same layer kernels and keeps its own
  chunked loss). --compile and --packing are refused: their TRL counterparts do something else.
- loss: Trainer counts the target tokens of all micro-batches and ranks of a step (num_items_in_batch)
  and TRL divides the token-loss sum by it: the mean over the global batch, as in the recipe
  (trl_run.json records `model_accepts_loss_kwargs`, which that needs).

Writes to --output-dir: metrics.jsonl in the recipe's format (one "train" line per optimizer step:
`step`, `tokens` = target tokens of the global step counted from the micro-batches TRL's collator
built, `elapsed_s` since training began) and trl_run.json (threads, versions, settings that ran).
"""

from __future__ import annotations

import json
import os
import sys
import time
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))  # the recipe's own flags, data loading and rendering

from common.launching import args as cli  # noqa: E402


def flags():
    parser = cli.recipe_parser(__doc__)
    cli.add_lora_args(parser)
    return parser


if __name__ == "__main__":
    cli.answer_help_with(flags)  # before the libraries below load (seconds)

from common.data import batches, checked_rows, formats, preparation, tokens  # noqa: E402
from common.launching.preflight import refuse  # noqa: E402
from common.model import modeling  # noqa: E402
from common.training import runtime  # noqa: E402


def parse_args(argv=None):
    return flags().parse_args(argv)


def recipe_rows(args, tokenizer):
    """(prompt/completion rows, the recipe's tokenised rows), index for index: the rows the recipe
    trains on (preparation.tokenize drops those whose targets --max-length cut off)."""
    rows, _ = checked_rows.load_splits(args.dataset, args.seed, args.columns)
    fmt = formats.detect_format(rows.column_names)
    if fmt not in ("instruction", "prompt_completion"):
        refuse(f"the TRL comparison takes instruction or prompt/completion data; --dataset is `{fmt}`")
    expected, _ = preparation.tokenize(rows, tokenizer, args.max_length)
    prompt_completion = []
    for row in rows:
        labels = tokens.tokenize_row(row, tokenizer, fmt, args.max_length)["labels"]
        if any(label != formats.IGNORE for label in labels[1:]):
            prompt, completion = formats.split_prompt(row, fmt)
            prompt_completion.append({"prompt": prompt, "completion": completion})
    if len(prompt_completion) != len(expected):
        refuse(f"kept {len(prompt_completion)} rows, the recipe keeps {len(expected)}")
    return prompt_completion, expected


def training_order(rows: int, seed: int, steps: int, batch_size: int, grad_accum: int, processes: int) -> list[int]:
    """Row indices in the order recipes/lora.py's prepared loader reads them, `steps` optimizer steps long.

    The loader shuffles with accelerate's SeedableRandomSampler (seed + epoch; the recipe's
    set_seed makes the seed --seed), cuts the permutation into batches of `batch_size` and deals them
    to the ranks in turn; each epoch uses only whole optimizer steps. Read sequentially by a loader
    that deals batches the same way, these indices give every rank the recipe's micro-batches.
    """
    from accelerate.data_loader import SeedableRandomSampler

    steps_per_epoch = batches.steps_per_epoch(rows // batch_size // processes, grad_accum)
    rows_per_step = batch_size * grad_accum * processes
    sampler = SeedableRandomSampler(range(rows), data_seed=seed)
    order, epoch = [], 0
    while len(order) < steps * rows_per_step:
        sampler.set_epoch(epoch)
        order += list(sampler)[: steps_per_epoch * rows_per_step]
        epoch += 1
    return order[: steps * rows_per_step]


def checkpointing_settings(config_class, every_n: int) -> dict:
    """The recipe's --gradient-checkpointing [N] as TrainingArguments fields (TRL turns checkpointing on by
    default, so it is always set). transformers 5.23 renamed them to activation_checkpointing*; before it,
    Trainer passes gradient_checkpointing_kwargs to torch's checkpoint, which has no every-Nth-layer form."""
    import dataclasses

    if "activation_checkpointing" in {field.name for field in dataclasses.fields(config_class)}:
        return {"activation_checkpointing": bool(every_n),
                "activation_checkpointing_kwargs": {"every_n_layers": every_n} if every_n > 1 else None}
    if every_n > 1:
        refuse(f"TRL's side checkpoints every Nth layer only with transformers >= 5.23 (this is "
               f"{version('transformers')}); pass --gradient-checkpointing without N")
    return {"gradient_checkpointing": bool(every_n)}


def sft_config(args, processes: int):
    """SFTConfig with the recipe's settings (see the module docstring for each choice)."""
    import torch
    from trl import SFTConfig

    checkpoint_every = int(args.gradient_checkpointing or 0)
    return SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        # An int, as the recipe computes it: Trainer would read a float < 1 as a ratio and round it up.
        warmup_steps=int(args.warmup_ratio * args.max_steps),
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        optim="adamw_torch_fused",
        seed=args.seed,
        bf16=launched_in_bf16(),  # as the launcher's --mixed_precision (the recipe's autocast)
        fp16=False,
        **checkpointing_settings(SFTConfig, checkpoint_every),
        max_length=args.max_length,
        packing=False,
        use_liger_kernel=bool(args.liger),
        completion_only_loss=True,
        train_sampling_strategy="sequential",  # the rows come in the recipe's shuffled order
        ddp_find_unused_parameters=False if processes > 1 else None,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        logging_steps=logging_interval(args.max_steps),
        disable_tqdm=True,
        # Trainer treats a launch without GPUs as distributed only when told it runs on CPU (the recipe
        # tells accelerate the same); otherwise each rank would train alone on all the rows.
        use_cpu=not torch.cuda.is_available(),
        dataloader_pin_memory=torch.cuda.is_available(),
    )


def logging_interval(steps: int) -> int:
    """About 4 loss lines per run (TRL's default is every 10 steps), on an interval that divides
    `steps`: Trainer's training_loss averages the ranks only over logged steps."""
    return next(every for every in range(max(1, steps // 4), 0, -1) if steps % every == 0)


class CountingCollator:
    """TRL's own collator, plus each micro-batch's target-token count (as the recipe counts them)."""

    def __init__(self, collate):
        self.collate = collate
        self.counts = []

    def __call__(self, examples):
        batch = self.collate(examples)
        self.counts.append(int(batches.target_tokens(batch)))
        return batch


def make_step_clock():
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """Seconds from the start of training to the end of each optimizer step."""

        def __init__(self):
            self.started = None
            self.step_ends = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_ends.append(time.perf_counter() - self.started)

    return StepClock()


def check_same_tokens(trainer_rows, expected_rows) -> None:
    """TRL's tokenised rows must be the recipe's, in the same order: same input_ids, same trained positions."""
    if len(trainer_rows) != len(expected_rows):
        refuse(f"TRL prepared {len(trainer_rows)} rows, the recipe's order has {len(expected_rows)}")
    for position, (theirs, ours) in enumerate(zip(trainer_rows, expected_rows)):
        if theirs["input_ids"] != ours["input_ids"] or theirs["labels"] != ours["labels"]:
            refuse(f"row {position}: TRL's tokens differ from the recipe's (TRL {theirs}, recipe {ours})")


def launched_in_bf16() -> bool:
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "bf16"


def build_trainer(args, tokenizer, train_rows, callbacks=(), processes: int = 1):
    """SFTTrainer on `train_rows` (prompt/completion dicts) with the recipe's model, LoRA and settings."""
    import datasets
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    attention = {"attn_implementation": args.attention} if args.attention else {}  # default: transformers' (SDPA)
    # The frozen base in the recipe's dtype: bf16 under bf16 mixed precision (modeling / Launch.float_dtype)
    dtype = torch.bfloat16 if launched_in_bf16() else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, use_safetensors=True, **attention)
    lora_config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=cli.lora_targets(args.lora_targets),
        task_type="CAUSAL_LM",
    )
    return SFTTrainer(
        model=model,
        args=sft_config(args, processes),
        train_dataset=datasets.Dataset.from_list(train_rows),
        processing_class=tokenizer,
        peft_config=lora_config,
        callbacks=list(callbacks),
    )


def main():
    args = parse_args()
    unmatched = [f"--{flag}" for flag in ("packing", "compile") if getattr(args, flag)]
    if unmatched:
        refuse(f"the TRL worker does not mirror {', '.join(unmatched)} (TRL's counterparts do something else)")
    if not args.max_steps:
        refuse("the TRL worker needs --max-steps (it trains on exactly the recipe's first N steps)")
    if (args.dataloader_workers or 0) > 0:
        refuse("the TRL worker collates in its main process: it counts each batch's target tokens there")
    import torch

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer = modeling.load_tokenizer(args.model, chat_template=args.chat_template)
    prompt_completion, expected = recipe_rows(args, tokenizer)
    order = training_order(len(expected), args.seed, args.max_steps, args.batch_size, args.grad_accum, processes)

    clock = make_step_clock()
    trainer = build_trainer(args, tokenizer, [prompt_completion[i] for i in order], [clock], processes)
    check_same_tokens(trainer.train_dataset.select_columns(["input_ids", "labels"]), [expected[i] for i in order])
    counter = CountingCollator(trainer.data_collator)
    trainer.data_collator = counter  # the train loader is built in train(), with this collator

    train_output = trainer.train()

    # Target tokens of each optimizer step: this rank's micro-batches (the loader reads one batch
    # ahead, so drop what was collated past the last step), summed over the ranks.
    micro_batches = args.max_steps * args.grad_accum
    if len(counter.counts) < micro_batches or len(clock.step_ends) != args.max_steps:
        refuse(f"TRL ran {len(clock.step_ends)} steps over {len(counter.counts)} micro-batches; "
               f"expected {args.max_steps} steps over {micro_batches}")
    local = torch.tensor(counter.counts[:micro_batches]).view(args.max_steps, args.grad_accum).sum(dim=1)
    per_step = trainer.accelerator.gather(local).view(-1, args.max_steps).sum(dim=0).tolist()
    if trainer.accelerator.is_main_process:
        output = Path(args.output_dir)
        output.mkdir(parents=True, exist_ok=True)
        with open(output / "metrics.jsonl", "w") as metrics:
            for step, (tokens, elapsed) in enumerate(zip(per_step, clock.step_ends), start=1):
                record = {"type": "train", "step": step, "tokens": int(tokens), "elapsed_s": round(elapsed, 4)}
                metrics.write(json.dumps(record) + "\n")
        import trl

        record = {
            "side": "trl",
            "trl": trl.__version__,
            "processes": processes,
            "torch_threads": torch.get_num_threads(),
            "train_loss": train_output.training_loss,  # mean over the steps of the global-batch loss
            "model_accepts_loss_kwargs": bool(trainer.model_accepts_loss_kwargs),
            "average_tokens_across_devices": bool(trainer.args.average_tokens_across_devices),
            "activation_checkpointing": bool(trainer.args.activation_checkpointing),
            "optim": str(trainer.args.optim),
            "arguments": vars(args),
        }
        (output / "trl_run.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"trl: done, {args.max_steps} steps; metrics in {output / 'metrics.jsonl'}")
    # Leave together and close the process group, as the recipe does: a rank that exits while the other
    # still holds the group can abort in gloo's teardown.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
    runtime.exit_after_a_finished_run()
