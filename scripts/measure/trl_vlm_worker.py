#!/usr/bin/env python
"""recipes/lora.py's workload on rows with images, trained by TRL's SFTTrainer, one process, for a side-by-side
comparison of the loss and gradient norm step by step:

    python scripts/measure/trl_vlm_worker.py --model models/tiny-qwen2-vl --dataset rows.jsonl \\
        --output-dir outputs/trl-vlm --max-steps 3 --batch-size 8 --lr 5e-3 --lora-dropout 0 --warmup-ratio 0

It parses the recipe's own flags (recipes/common/launching/args.py), so every default is the recipe's, and sets
SFTTrainer up to do what the recipe does: the model's image-text-to-text class in float32, LoRA on the language
model's layers (modeling.lora_targets) drawn again from the seed as the recipe draws it (modeling.seed_adapter),
the model's processor as the recipe loads it (processors.load), fused AdamW with the recipe's lr,
int(warmup_ratio x steps) warm-up steps, cosine decay, max_grad_norm, weight decay; no evaluation, checkpoints or
reporting. Each chat row (one reply, its images in the user's turns) is given to TRL as a prompt / completion row
of text: the prompt the recipe's rendering up to where the reply starts, the completion the reply through its
end-of-turn token (what the recipe trains), its images beside; TRL's vision collator expands the images and trains
the completion only. TRL reads the rows in its own shuffled order: compare steps whose batch is the whole dataset
(--batch-size = the number of rows).

Writes --output-dir/metrics.jsonl: one line per optimizer step with TRL's `loss` and `grad_norm` and `elapsed_s`
since training began.
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
    cli.answer_help("lora", __doc__)  # before the libraries below load (seconds)

from common.data import images, targets  # noqa: E402
from common.data.formats import conversation  # noqa: E402
from common.model import modeling, processors  # noqa: E402
from common.refusal import refuse  # noqa: E402


def prompt_completion_rows(path: str, tokenizer) -> list[dict]:
    """The chat rows of `path` as TRL's prompt / completion rows of text, rendered as the recipe renders them."""
    chat = targets.ChatTemplate(tokenizer, images=True)
    folder = images.folder_of(path)
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        row = json.loads(line)
        rendering = targets.render_chat(conversation(row.get("messages", row.get("conversations"))), chat)
        if len(rendering.spans) != 1:
            refuse(f"{path} row {number}: the comparison takes rows of one reply")
        start, end = rendering.spans[0]
        rows.append({"prompt": rendering.text[:start], "completion": rendering.text[start:end],
                     "images": [images.load_image(images.image_path(reference, folder))
                                for reference in images.references(row.get(images.image_column(row) or "images"))]})
    return rows


def main(argv=None) -> None:
    run = cli.parse_args(cli.recipe_flags("lora", __doc__), argv)
    import datasets
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(run.seed)
    tokenizer = modeling.load_tokenizer(run.model, run.trust_remote_code, run.chat_template)
    processor = processors.load(run.model, tokenizer, run.trust_remote_code)
    if processor is None:
        refuse(f"--model {run.model} reads text only; the comparison is of a vision-language model")
    model = AutoModelForImageTextToText.from_pretrained(run.model, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=run.lora_r, lora_alpha=run.lora_alpha, lora_dropout=run.lora_dropout,
                                             target_modules=modeling.lora_targets(model, cli.lora_targets(run.lora_targets)),
                                             task_type="CAUSAL_LM"))
    modeling.seed_adapter(model, run.seed)
    rows = datasets.Dataset.from_list(prompt_completion_rows(run.dataset[0], tokenizer))
    output_dir = Path(run.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    config = SFTConfig(
        output_dir=str(output_dir), max_steps=run.max_steps, per_device_train_batch_size=run.batch_size,
        gradient_accumulation_steps=run.grad_accum, learning_rate=run.lr, lr_scheduler_type="cosine",
        warmup_steps=int(run.warmup_ratio * run.max_steps), weight_decay=run.weight_decay,
        max_grad_norm=run.max_grad_norm, seed=run.seed, max_length=None, completion_only_loss=True, bf16=False,
        fp16=False, use_cpu=True, logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[],
        optim="adamw_torch_fused", dataloader_num_workers=0, gradient_checkpointing=False,
    )
    recorder = step_recorder(("loss", "grad_norm"))
    trainer = SFTTrainer(model=model, args=config, train_dataset=rows, processing_class=processor, callbacks=[recorder])
    trainer.train()
    recorder.write(output_dir)


if __name__ == "__main__":
    main()
