#!/usr/bin/env python
"""recipes/reward.py's workload trained by TRL's RewardTrainer, one process, for a side-by-side comparison:

    python scripts/measure/trl_reward_worker.py --dataset pairs.jsonl --output-dir outputs/trl-reward --max-steps 3 \\
        --batch-size 8 --lr 5e-3 --lora-dropout 0 --warmup-ratio 0 --lora-targets q_proj,v_proj

It parses the recipe's own flags (recipes/common/launching/args.py), so every default (lr, warm-up, clipping,
LoRA r / alpha / dropout / targets, seed, the centring coefficient) is the recipe's, and sets RewardTrainer up to
do what the recipe does: the tiny model as AutoModelForSequenceClassification with one label, its score head
drawn as the recipe draws it (score_head.initial_score), the adapter built by peft (task SEQ_CLS: the score head
trained in full) and drawn again from the seed as the recipe draws it (modeling.seed_adapter), fused AdamW with
the recipe's lr, int(warmup_ratio x steps) warm-up steps, cosine decay, max_grad_norm, weight decay; fp32 on CPU;
no evaluation, checkpoints or reporting. Give --lora-targets by name: "all-linear" picks the score head too on a
sequence classifier. Compare steps whose batch is the whole dataset (TRL reads the rows in its own order).

Writes --output-dir/metrics.jsonl: one line per optimizer step with TRL's logged names (loss, grad_norm,
accuracy, margin, mean_reward) and `elapsed_s` since training began.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))

from common.launching import args as cli  # noqa: E402
from trl_steps import step_recorder  # noqa: E402

if __name__ == "__main__":
    cli.answer_help("reward", __doc__)  # before the libraries below load (seconds)

from common.model import modeling, score_head  # noqa: E402

LOGGED = ("loss", "grad_norm", "accuracy", "margin", "mean_reward")


def main(argv=None) -> None:
    run = cli.parse_args(cli.recipe_flags("reward", __doc__), argv)
    import datasets
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    torch.manual_seed(run.seed)
    tokenizer = modeling.load_tokenizer(run.model, run.trust_remote_code, run.chat_template)
    model = AutoModelForSequenceClassification.from_pretrained(run.model, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    with torch.no_grad():
        model.score.weight.copy_(score_head.initial_score(model.config.hidden_size, model.config.initializer_range,
                                                          run.seed))
    model = get_peft_model(model, LoraConfig(r=run.lora_r, lora_alpha=run.lora_alpha, lora_dropout=run.lora_dropout,
                                             target_modules=cli.lora_targets(run.lora_targets), task_type="SEQ_CLS"))
    modeling.seed_adapter(model, run.seed)
    pairs = datasets.load_dataset("json", data_files=run.dataset[0], split="train")
    output_dir = Path(run.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    config = RewardConfig(
        output_dir=str(output_dir), max_steps=run.max_steps, per_device_train_batch_size=run.batch_size,
        gradient_accumulation_steps=run.grad_accum, learning_rate=run.lr, lr_scheduler_type="cosine",
        warmup_steps=int(run.warmup_ratio * run.max_steps), weight_decay=run.weight_decay,
        max_grad_norm=run.max_grad_norm, seed=run.seed, max_length=run.max_length,
        center_rewards_coefficient=run.center_rewards_coefficient or None, bf16=False, fp16=False, use_cpu=True,
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[], optim="adamw_torch_fused",
        dataloader_num_workers=0, gradient_checkpointing=False,
    )
    recorder = step_recorder(LOGGED)

    trainer = RewardTrainer(model=model, args=config, train_dataset=pairs, processing_class=tokenizer,
                            callbacks=[recorder])
    trainer.train()
    recorder.write(output_dir)


if __name__ == "__main__":
    main()
