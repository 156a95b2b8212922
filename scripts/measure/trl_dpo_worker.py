#!/usr/bin/env python
"""recipes/dpo.py's workload trained by TRL's DPOTrainer (with --loss orpo, trl.experimental's ORPOTrainer), one
process, for a side-by-side comparison:

    python scripts/measure/trl_dpo_worker.py --dataset pairs.jsonl --output-dir outputs/trl-dpo --max-steps 3 \\
        --batch-size 8 --lr 5e-3 --lora-dropout 0 --warmup-ratio 0

It parses the recipe's own flags (recipes/common/launching/args.py), so every default (lr, warm-up, clipping,
LoRA r / alpha / dropout / targets, seed, beta, loss) is the recipe's, and sets DPOTrainer up to do what the
recipe does: the adapter built by peft and drawn again from the seed as the recipe draws it
(modeling.seed_adapter), the reference = the base with the adapter switched off (TRL's default for a peft
model), fused AdamW with the recipe's lr, int(warmup_ratio x steps) warm-up steps, cosine decay,
max_grad_norm, weight decay; fp32 on CPU; no evaluation, checkpoints or reporting. Rows are standard-text
prompt / chosen / rejected pairs (TRL appends EOS to each reply as the recipe does). TRL reads the rows in its
own shuffled order: compare steps whose batch is the whole dataset (--batch-size = the number of pairs).

A vision-language --model (recipes/dpo.py on pairs whose prompt places images) is given to DPOTrainer with its
processor (processors.load, as the recipe loads it) and its image-text-to-text class, LoRA on its language model
(modeling.lora_targets); each pair as text rendered as the recipe renders its sides (trl_vlm_worker's
prompt_completion_row): the prompt up to where the reply starts, each reply through its end-of-turn token, the images
beside (TRL's DataCollatorForVisionPreference).

Writes --output-dir/metrics.jsonl: one line per optimizer step with TRL's logged names (loss,
rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected) and
`elapsed_s` since training began.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))

from common.launching import args as cli  # noqa: E402
from trl_steps import step_recorder  # noqa: E402

if __name__ == "__main__":
    cli.answer_help("dpo", __doc__)  # before the libraries below load (seconds)

from common.data import images, targets  # noqa: E402
from common.data.formats import conversation  # noqa: E402
from common.model import modeling, processors  # noqa: E402
from trl_vlm_worker import prompt_completion_row  # noqa: E402

LOGGED = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
          "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen")


def main(argv=None) -> None:
    run = cli.parse_args(cli.recipe_flags("dpo", __doc__), argv)
    import datasets
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(run.seed)
    tokenizer = modeling.load_tokenizer(run.model, run.trust_remote_code, run.chat_template)
    processor = processors.load(run.model, tokenizer, run.trust_remote_code)  # None: a model of text
    model_class = AutoModelForCausalLM if processor is None else AutoModelForImageTextToText
    model = model_class.from_pretrained(run.model, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=run.lora_r, lora_alpha=run.lora_alpha, lora_dropout=run.lora_dropout,
                                             target_modules=modeling.lora_targets(model, cli.lora_targets(run.lora_targets)),
                                             task_type="CAUSAL_LM"))
    modeling.seed_adapter(model, run.seed)
    if processor is None:
        pairs = datasets.load_dataset("json", data_files=run.dataset[0], split="train")
    else:
        pairs = datasets.Dataset.from_list(image_pairs(run.dataset[0], tokenizer))
    output_dir = Path(run.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    common = dict(
        output_dir=str(output_dir), max_steps=run.max_steps, per_device_train_batch_size=run.batch_size,
        gradient_accumulation_steps=run.grad_accum, learning_rate=run.lr, lr_scheduler_type="cosine",
        warmup_steps=int(run.warmup_ratio * run.max_steps), weight_decay=run.weight_decay,
        max_grad_norm=run.max_grad_norm, seed=run.seed, beta=run.beta, max_length=run.max_length, bf16=False,
        fp16=False, use_cpu=True, logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[],
        optim="adamw_torch_fused", dataloader_num_workers=0, gradient_checkpointing=False, remove_unused_columns=False,
    )
    if run.loss == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        config, trainer_class = ORPOConfig(**common), ORPOTrainer
    else:
        config, trainer_class = DPOConfig(**common, loss_type=[run.loss]), DPOTrainer
    recorder = step_recorder(LOGGED)

    trainer = trainer_class(model=model, args=config, train_dataset=pairs, processing_class=processor or tokenizer,
                            callbacks=[recorder])
    trainer.train()
    recorder.write(output_dir)


def image_pairs(path: str, tokenizer) -> list[dict]:
    """The conversational pairs of the file `path` (prompt turns placing its images, one chosen and one rejected
    reply), in file order, as TRL's text pairs with their images."""
    chat, folder = targets.ChatTemplate(tokenizer, images=True), images.folder_of(path)
    pairs = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        pair = json.loads(line)
        sides = [prompt_completion_row({"messages": conversation(pair["prompt"]) + conversation(pair[side]),
                                        "images": pair.get("images")}, chat, folder, f"{path} row {number}")
                 for side in ("chosen", "rejected")]
        assert sides[0]["prompt"] == sides[1]["prompt"], f"{path} row {number}: the sides' prompts differ"
        pairs.append({"prompt": sides[0]["prompt"], "chosen": sides[0]["completion"],
                      "rejected": sides[1]["completion"], "images": sides[0]["images"]})
    return pairs


if __name__ == "__main__":
    main()
