#!/usr/bin/env python
"""recipes/lora.py's workload on rows with images, trained by TRL's SFTTrainer: the loss and gradient norm step by
step beside the recipe's (one process), and, with --recipe-order, the TRL side of scripts/measure/compare_trl_vlm.py
(any number of processes, the recipe's micro-batches):

    python scripts/measure/trl_vlm_worker.py --model models/tiny-qwen2-vl --dataset rows.jsonl \\
        --output-dir outputs/trl-vlm --max-steps 3 --batch-size 8 --lr 5e-3 --lora-dropout 0 --warmup-ratio 0
    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 --mixed_precision no \\
        scripts/measure/trl_vlm_worker.py --recipe-order --model models/tiny-qwen2-vl --dataset data/vision \\
        --output-dir outputs/trl-vlm-ddp --max-steps 120 --batch-size 8 --grad-accum 2

It parses the recipe's own flags (recipes/common/launching/args.py), so every default is the recipe's, and sets
SFTTrainer up to do what the recipe does: the model's image-text-to-text class in float32 (bf16 under the launcher's
--mixed_precision bf16), LoRA on the language model's layers (modeling.lora_targets) drawn again from the seed as the
recipe draws it (modeling.seed_adapter), the model's processor as the recipe loads it (processors.load), fused AdamW
with the recipe's lr, int(warmup_ratio x steps) warm-up steps, cosine decay, max_grad_norm, weight decay; no
evaluation, checkpoints or reporting; find_unused_parameters off (every adapter gets a gradient). Each chat row (one
reply, its images in the user's turns) is given to TRL as a prompt / completion row of text: the prompt the recipe's
rendering up to where the reply starts, the completion the reply through its end-of-turn token (what the recipe
trains), its images beside; TRL's vision collator expands the images and trains the completion only. PaliGemma's
rows go through its processor's `suffix` instead (TRL's collator calls it on completions without images, which it
refuses): its documented fine-tuning, read from the turns.

Rows and order: by default the rows of --dataset (one file) in TRL's own shuffled order: compare steps whose batch is
the whole dataset (--batch-size = the number of rows). With --recipe-order, the recipe's training rows (its split of
--dataset, --eval-dataset as the recipe takes it) in the order its loader deals them to the ranks
(trl_sft_worker.training_order), read sequentially: every rank gets the recipe's micro-batches. Each side of
compare_trl_vlm.py then counts the same target tokens every step; it checks that. TRL logs then as
trl_sft_worker.py has it log (the first step, then about 4 times a run), not every step.

Writes to --output-dir: metrics.jsonl, one line per optimizer step: `tokens` (the global step's target tokens,
counted from the micro-batches TRL's collator built), `elapsed_s` (seconds from the start of training to the end of
the step) and, at the steps TRL logs, its `loss` (the mean over the steps since its previous log: step 1's own at
step 1) and `grad_norm`; trl_run.json (threads, versions, the mean loss);
adapter/ (the trained adapter and the processor: the end of the run, as the recipe's).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))
sys.path.insert(0, str(REPO / "scripts" / "measure"))

from common.launching import args as cli  # noqa: E402


def flags():
    parser = cli.recipe_flags("lora", __doc__)
    parser.add_argument("--recipe-order", action="store_true",
                        help="the recipe's training rows in its loader's order, on every rank (see above)")
    return parser


if __name__ == "__main__":
    cli.answer_help_with(flags)  # before the libraries below load (seconds)

from common.data import checked_rows, images, targets  # noqa: E402
from common.data.formats import conversation, lays_out_prompt, text_parts  # noqa: E402
from common.model import modeling, processors  # noqa: E402
from common.refusal import refuse  # noqa: E402
from common.training import runtime  # noqa: E402
from trl_sft_worker import (CountingCollator, launched_in_bf16, logging_interval, make_step_clock,  # noqa: E402
                            training_order)
from trl_steps import step_recorder  # noqa: E402


def prompt_completion_row(row: dict, chat, folder: Path, where: str, processor=None) -> dict:
    """One chat row as TRL's prompt / completion row of text, rendered as the recipe renders it, its images beside.
    For a processor that lays its prompt out itself (PaliGemma), the row as its own fine-tuning takes it, read from
    the turns (not from the recipe's rendering): the prompt its images' tokens then the user's text, the reply the
    completion (`suffix_collator`)."""
    turns = conversation(row.get("messages", row.get("conversations")))
    files = [images.load_image(images.image_path(reference, folder))
             for reference in images.references(row.get(images.image_column(row) or "images"))]
    if processor is not None and lays_out_prompt(processor):
        if [turn["role"] for turn in turns] != ["user", "assistant"]:
            refuse(f"{where}: the comparison takes rows of one user turn and one reply")
        parts = turns[0].get("parts") or text_parts(turns[0]["content"])
        prompt = processor.image_token * len(files) + "".join(part.get("text", "") for part in parts)
        return {"prompt": prompt, "completion": turns[1]["content"], "images": files}
    rendering = targets.render_chat(turns, chat)
    if len(rendering.spans) != 1:
        refuse(f"{where}: the comparison takes rows of one reply")
    start, end = rendering.spans[0]
    return {"prompt": rendering.text[:start], "completion": rendering.text[start:end], "images": files}


def prompt_completion_rows(path: str, tokenizer, processor=None) -> list[dict]:
    """The chat rows of the file `path`, in file order, as TRL's rows."""
    chat, folder = targets.ChatTemplate(tokenizer, images=True), images.folder_of(path)
    return [prompt_completion_row(json.loads(line), chat, folder, f"{path} row {number}", processor)
            for number, line in enumerate(Path(path).read_text().splitlines(), 1)]


def suffix_collator(processor):
    """TRL's vision collator calls the processor on the completions alone, which PaliGemma's refuses (it takes no
    text without images): its fine-tuning as its processor documents it instead, the prompt and images as `text`
    and `images`, the completion as `suffix` (its tokens, `token_type_ids` and `labels` the processor's)."""
    def collate(rows: list[dict]) -> dict:
        return processor(text=[row["prompt"] for row in rows], images=[row["images"] for row in rows],
                         suffix=[row["completion"] for row in rows], padding=True, return_tensors="pt")

    return collate


def recipe_rows(run, tokenizer, processes: int, processor=None) -> list[dict]:
    """The recipe's training rows of --dataset, as TRL's rows, in the order the recipe's loader deals them."""
    if len(run.dataset or []) != 1:
        refuse("--recipe-order takes one --dataset (a file or a folder), as the comparison gives it")
    rows, _ = checked_rows.load_splits(run.dataset, run.seed, run.columns, run.eval_dataset)
    chat, folder = targets.ChatTemplate(tokenizer, images=True), images.folder_of(run.dataset[0])
    order = training_order(len(rows), run.seed, run.max_steps, run.batch_size, run.grad_accum, processes)
    rendered = {}  # a row read again in a later epoch is rendered once
    for index in set(order):
        row = rows[index]
        rendered[index] = prompt_completion_row(row, chat, folder, f"{run.dataset[0]} row {row.get(images.ROW_NUMBER)}",
                                                processor)
    return [rendered[index] for index in order]


def announcer():
    """A TrainerCallback that prints `trl: training` where the step clock starts (compare_trl_vlm.py times the launch
    up to this line as its start-up)."""
    from transformers import TrainerCallback

    class Announcer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                print("trl: training", flush=True)

    return Announcer()


def main(argv=None) -> None:
    run = cli.parse_args(flags(), argv)
    if not run.max_steps:
        refuse("the TRL worker needs --max-steps (it trains exactly the recipe's first N steps)")
    if (run.dataloader_workers or 0) > 0:
        refuse("the TRL worker collates in its main process: it counts each batch's target tokens there")
    unmatched = [f"--{flag.replace('_', '-')}" for flag in ("train_vision_tower", "train_projector", "packing", "compile")
                 if getattr(run, flag, False)]
    if unmatched:
        refuse(f"the TRL worker does not mirror {', '.join(unmatched)}: it trains the language model's adapters only")
    import datasets
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText
    from trl import SFTConfig, SFTTrainer

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(run.seed)
    tokenizer = modeling.load_tokenizer(run.model, run.trust_remote_code, run.chat_template)
    processor = processors.load(run.model, tokenizer, run.trust_remote_code)
    if processor is None:
        refuse(f"--model {run.model} reads text only; the comparison is of a vision-language model")
    rows = (recipe_rows(run, tokenizer, processes, processor) if run.recipe_order
            else prompt_completion_rows(run.dataset[0], tokenizer, processor))
    model = AutoModelForImageTextToText.from_pretrained(
        run.model, dtype=torch.bfloat16 if launched_in_bf16() else torch.float32)
    model = get_peft_model(model, LoraConfig(r=run.lora_r, lora_alpha=run.lora_alpha, lora_dropout=run.lora_dropout,
                                             target_modules=modeling.lora_targets(model, cli.lora_targets(run.lora_targets)),
                                             task_type="CAUSAL_LM"))
    modeling.seed_adapter(model, run.seed)
    output_dir = Path(run.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    on_gpu = torch.cuda.is_available()
    logging = (dict(logging_steps=logging_interval(run.max_steps), logging_first_step=True) if run.recipe_order
               else dict(logging_steps=1))
    config = SFTConfig(
        output_dir=str(output_dir), max_steps=run.max_steps, per_device_train_batch_size=run.batch_size,
        gradient_accumulation_steps=run.grad_accum, learning_rate=run.lr, lr_scheduler_type="cosine",
        warmup_steps=int(run.warmup_ratio * run.max_steps), weight_decay=run.weight_decay,
        max_grad_norm=run.max_grad_norm, seed=run.seed, max_length=None, completion_only_loss=True,
        bf16=launched_in_bf16(), fp16=False, use_cpu=not on_gpu, dataloader_pin_memory=on_gpu, **logging,
        save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True, optim="adamw_torch_fused",
        dataloader_num_workers=0, gradient_checkpointing=False,
        ddp_find_unused_parameters=False if processes > 1 else None,
        # the rows come in the recipe's shuffled order, already dealt for the ranks
        **(dict(train_sampling_strategy="sequential") if run.recipe_order else {}),
    )
    recorder, clock = step_recorder(("loss", "grad_norm")), make_step_clock()
    trainer = SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=processor, callbacks=[recorder, clock, announcer()],
                         data_collator=suffix_collator(processor) if lays_out_prompt(processor) else None)
    counter = CountingCollator(trainer.data_collator)
    trainer.data_collator = counter  # the train loader is built in train(), with this collator
    train_output = trainer.train()
    if trainer.accelerator.is_main_process:  # the adapter and the processor, as the recipe's run ends
        trainer.model.save_pretrained(str(output_dir / "adapter"))
        processors.save(processor, output_dir / "adapter")  # Trainer's save stops at a processor without its video part

    # Target tokens of each optimizer step: this rank's micro-batches (the loader reads one batch ahead, so what was
    # collated past the last step is dropped), summed over the ranks.
    micro_batches = run.max_steps * run.grad_accum
    if len(counter.counts) < micro_batches or len(clock.step_ends) != run.max_steps:
        refuse(f"TRL ran {len(clock.step_ends)} steps over {len(counter.counts)} micro-batches; "
               f"expected {run.max_steps} steps over {micro_batches}")
    local = torch.tensor(counter.counts[:micro_batches]).view(run.max_steps, run.grad_accum).sum(dim=1)
    per_step = trainer.accelerator.gather(local).view(-1, run.max_steps).sum(dim=0).tolist()
    if trainer.accelerator.is_main_process:
        logged = {record["step"]: record for record in recorder.records}
        with open(output_dir / "metrics.jsonl", "w") as metrics:
            for step, (tokens, elapsed) in enumerate(zip(per_step, clock.step_ends), start=1):
                record = {**logged.get(step, {"type": "train", "step": step}), "tokens": int(tokens),
                          "elapsed_s": round(elapsed, 4)}
                metrics.write(json.dumps(record) + "\n")
        import trl

        record = {"side": "trl", "trl": trl.__version__, "processes": processes, "torch_threads": torch.get_num_threads(),
                  "train_loss": train_output.training_loss,  # the mean over the steps of the global-batch loss
                  "model_accepts_loss_kwargs": bool(trainer.model_accepts_loss_kwargs),
                  "average_tokens_across_devices": bool(trainer.args.average_tokens_across_devices),
                  "arguments": vars(run)}
        (output_dir / "trl_run.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"trl: done, {run.max_steps} steps; adapter saved to {output_dir / 'adapter'}")
    # Leave together and close the process group, as the recipe does (a rank leaving first can abort gloo's teardown).
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
    runtime.exit_after_a_finished_run()
