#!/usr/bin/env python
"""recipes/grpo.py's workload trained by TRL's GRPOTrainer (RLOOTrainer for --loss rloo), one process, for a
side-by-side comparison:

    python scripts/measure/trl_grpo_worker.py --dataset prompts.jsonl --reward my_rewards.py:correct \\
        --output-dir outputs/trl-grpo --max-steps 3 --batch-size 8 --num-generations 4 --lr 1e-3

`--full` first: grpo_full.py's workload (every weight trains, its flags).

It parses the recipe's own flags (recipes/common/launching/args.py), so every default is the recipe's, and sets
the trainer up to do what the recipe does: the adapter built by peft and drawn again from the seed
(modeling.seed_adapter), the same reward functions (common/rewards.py loads them), fused AdamW, int(warmup_ratio x
steps) warm-up steps, cosine decay, clipping, weight decay; fp32 on CPU; no evaluation, checkpoints or reporting.
The completions are the recipe's: TRL's generation is replaced by the recipe's sampler (training/rollouts.py),
each completion drawn from the seed of its prompt, its place in its group and the generation batch, as the
recipe draws it. TRL reads the prompts in its own shuffled order: compare steps whose batch holds every prompt
(--batch-size x --grad-accum = prompts x --num-generations), and, for --loss bnpo (a mean per micro-batch),
--grad-accum 1.

`--trl-generation` (the TRL side of scripts/measure/compare_trl_grpo.py): TRL samples with its own generation
(transformers' generate with GRPOConfig's temperature, top-k and top-p), the step clock starts when training does
(the worker prints `trl: training` then), each step's line adds `generation_s` and `rewards_s` (rank 0's seconds
in TRL's generation and reward scoring), and the adapter is saved to --output-dir/adapter at the end, as the recipe's.

Writes --output-dir/metrics.jsonl: one line per optimizer step with TRL's logged names (loss, grad_norm, reward,
reward_std, frac_reward_zero_std, kl, clip_ratio/region_mean, completions/mean_length) and `elapsed_s`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes"))

from common.launching import args as cli  # noqa: E402
from trl_steps import step_recorder  # noqa: E402

if __name__ == "__main__":
    cli.answer_help("grpo", __doc__)  # before the libraries below load (seconds)

from common import rewards  # noqa: E402
from common.model import modeling  # noqa: E402
from common.training import rollouts  # noqa: E402

LOGGED = ("loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std", "kl", "clip_ratio/region_mean",
          "completions/mean_length")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    full = "--full" in argv  # grpo_full.py's workload: every weight trains, no adapter (TRL loads a reference copy)
    if full:
        argv.remove("--full")
    trl_generation = "--trl-generation" in argv  # TRL's own sampling, timed by part, the adapter saved
    if trl_generation:
        argv.remove("--trl-generation")
    run = cli.parse_args(cli.recipe_flags("grpo_full" if full else "grpo", __doc__), argv)
    import datasets
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    torch.manual_seed(run.seed)
    tokenizer = modeling.load_tokenizer(run.model, run.trust_remote_code, run.chat_template)
    model = AutoModelForCausalLM.from_pretrained(run.model, dtype=torch.float32)
    if not full:
        model = get_peft_model(model, LoraConfig(r=run.lora_r, lora_alpha=run.lora_alpha,
                                                 lora_dropout=run.lora_dropout,
                                                 target_modules=cli.lora_targets(run.lora_targets), task_type="CAUSAL_LM"))
        modeling.seed_adapter(model, run.seed)
    functions = [reward.function for reward in rewards.load_rewards(run.reward)]
    prompts = datasets.load_dataset("json", data_files=run.dataset[0], split="train")
    output_dir = Path(run.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    rloo = run.loss == "rloo"
    beta = run.beta if run.beta is not None else (0.05 if rloo else 0.0)
    common = dict(
        output_dir=str(output_dir), max_steps=run.max_steps, per_device_train_batch_size=run.batch_size,
        gradient_accumulation_steps=run.grad_accum, learning_rate=run.lr, lr_scheduler_type="cosine",
        warmup_steps=int(run.warmup_ratio * run.max_steps), weight_decay=run.weight_decay,
        max_grad_norm=run.max_grad_norm, seed=run.seed, bf16=False, fp16=False, use_cpu=True, logging_steps=1,
        save_strategy="no", eval_strategy="no", report_to=[], optim="adamw_torch_fused", dataloader_num_workers=0,
        gradient_checkpointing=False, num_generations=run.num_generations,
        max_completion_length=run.max_completion_length, temperature=run.temperature, top_p=run.top_p,
        top_k=run.top_k, beta=beta, epsilon=run.epsilon, epsilon_high=run.epsilon_high,
        num_iterations=run.num_iterations, mask_truncated_completions=run.mask_truncated_completions,
        reward_weights=[float(w) for w in run.reward_weights.split(",")] if run.reward_weights else None,
    )
    if rloo:
        config, trainer_class = RLOOConfig(**common, normalize_advantages=run.normalize_advantages), RLOOTrainer
    else:
        config, trainer_class = GRPOConfig(**common, loss_type=run.loss, scale_rewards=run.scale_rewards), GRPOTrainer
    recorder = step_recorder(LOGGED)

    class RecipeSampling(trainer_class):
        """TRL's trainer with the recipe's completions: each drawn from the seed the recipe gives it."""

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            generations = run.num_generations
            groups = [prompt_ids[i] for i in range(0, len(prompt_ids), generations)]
            occurrence = [sum(1 for earlier in groups[:k] if earlier == group) for k, group in enumerate(groups)]
            batch = self.state.global_step // run.num_iterations
            seeds = [rollouts.completion_seed(run.seed, batch, ids, occurrence[i // generations], i % generations)
                     for i, ids in enumerate(prompt_ids)]
            unwrapped = self.accelerator.unwrap_model(self.model)
            completions = rollouts.sample(self.accelerator, unwrapped, [list(ids) for ids in prompt_ids], seeds,
                                          max_new_tokens=run.max_completion_length, temperature=run.temperature,
                                          top_k=run.top_k, top_p=run.top_p,
                                          stop_ids=rollouts.stop_tokens(tokenizer, unwrapped),
                                          pad_id=tokenizer.pad_token_id)
            return completions if rloo else (completions, None)  # (RLOO's returns the ids alone)

    if trl_generation:
        trainer = timed_trainer(trainer_class, recorder)(model=model, reward_funcs=functions, args=config,
                                                         train_dataset=prompts, processing_class=tokenizer,
                                                         callbacks=[recorder])
    else:
        trainer = RecipeSampling(model=model, reward_funcs=functions, args=config, train_dataset=prompts,
                                 processing_class=tokenizer, callbacks=[recorder])
    trainer.train()
    if trl_generation:
        trainer.save_model(str(output_dir / "adapter"))
        for record in recorder.records:  # rank 0's seconds in each step's generation and scoring
            record.update(trainer.parts.get(record["step"], {}))
    if trainer.accelerator.is_main_process:
        recorder.write(output_dir)


def timed_trainer(trainer_class, recorder):
    """TRL's trainer with its own generation, timing each step's generation and reward scoring (`parts`: step ->
    {"generation_s", "rewards_s"}), its step clock (`recorder`'s) started when training starts."""
    from transformers import TrainerCallback

    class ClockStart(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            recorder.started = time.perf_counter()
            if state.is_world_process_zero:
                print("trl: training", flush=True)

    class Timed(trainer_class):
        def __init__(self, *args, callbacks=(), **kwargs):
            super().__init__(*args, callbacks=[ClockStart(), *callbacks], **kwargs)
            self.parts = {}

        def timed(self, name, call, *args, **kwargs):
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                part = self.parts.setdefault(self.state.global_step + 1, {})  # (the step it is for)
                part[name] = part.get(name, 0.0) + time.perf_counter() - started

        def _generate_single_turn(self, *args, **kwargs):
            return self.timed("generation_s", super()._generate_single_turn, *args, **kwargs)

        def _calculate_rewards(self, *args, **kwargs):
            return self.timed("rewards_s", super()._calculate_rewards, *args, **kwargs)

    return Timed


if __name__ == "__main__":
    main()
