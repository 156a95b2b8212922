#!/usr/bin/env python
"""recipes/kto.py's workload trained by TRL's KTOTrainer, one process, for a side-by-side comparison:

    python scripts/measure/trl_kto_worker.py --dataset feedback.jsonl --output-dir outputs/trl-kto --max-steps 3 \\
        --batch-size 8 --lr 5e-3 --lora-dropout 0 --warmup-ratio 0

It parses the recipe's own flags (recipes/common/launching/args.py), so every default (lr, warm-up, clipping,
LoRA r / alpha / dropout / targets, seed, beta, the desirable / undesirable weights) is the recipe's, and sets
KTOTrainer up to do what the recipe does: the adapter built by peft and drawn again from the seed as the recipe
draws it (modeling.seed_adapter), the reference = the base with the adapter switched off (TRL's default for a
peft model), fused AdamW with the recipe's lr, int(warmup_ratio x steps) warm-up steps, cosine decay,
max_grad_norm, weight decay; fp32 on CPU; no evaluation, checkpoints or reporting. Rows are standard-text
prompt / completion / label rows, or pairs (TRL unpairs them; it appends EOS to each reply as the recipe does).
TRL reads the rows in order and pairs each prompt with the previous reply of its batch for the KL estimate: with
--batch-size = the number of rows, its one batch pairs them as the recipe does (each row with the previous row).

Writes --output-dir/metrics.jsonl: one line per optimizer step with TRL's logged names (loss, grad_norm, kl,
rewards/chosen, rewards/rejected, rewards/margins, logps/chosen, logps/rejected) and `elapsed_s` since training
began.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))

from common.launching import args as cli  # noqa: E402
from trl_steps import step_recorder  # noqa: E402

if __name__ == "__main__":
    cli.answer_help("kto", __doc__)  # before the libraries below load (seconds)

from common.model import modeling  # noqa: E402

LOGGED = ("loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
          "logps/rejected")


def main(argv=None) -> None:
    run = cli.parse_args(cli.recipe_flags("kto", __doc__), argv)
    import datasets
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig, KTOTrainer

    torch.manual_seed(run.seed)
    tokenizer = modeling.load_tokenizer(run.model, run.trust_remote_code, run.chat_template)
    model = AutoModelForCausalLM.from_pretrained(run.model, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=run.lora_r, lora_alpha=run.lora_alpha, lora_dropout=run.lora_dropout,
                                             target_modules=cli.lora_targets(run.lora_targets), task_type="CAUSAL_LM"))
    modeling.seed_adapter(model, run.seed)
    rows = datasets.load_dataset("json", data_files=run.dataset[0], split="train")
    output_dir = Path(run.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    config = KTOConfig(
        output_dir=str(output_dir), max_steps=run.max_steps, per_device_train_batch_size=run.batch_size,
        gradient_accumulation_steps=run.grad_accum, learning_rate=run.lr, lr_scheduler_type="cosine",
        warmup_steps=int(run.warmup_ratio * run.max_steps), weight_decay=run.weight_decay,
        max_grad_norm=run.max_grad_norm, seed=run.seed, beta=run.beta, desirable_weight=run.desirable_weight,
        undesirable_weight=run.undesirable_weight, max_length=run.max_length, bf16=False, fp16=False, use_cpu=True,
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[], optim="adamw_torch_fused",
        dataloader_num_workers=0, gradient_checkpointing=False, remove_unused_columns=False,
    )
    recorder = step_recorder(LOGGED)

    trainer = KTOTrainer(model=model, args=config, train_dataset=rows, processing_class=tokenizer,
                         callbacks=[recorder])
    trainer.train()
    recorder.write(output_dir)


if __name__ == "__main__":
    main()
