"""Reward models: one score a reply, trained on preference pairs (the Bradley-Terry loss), of LoRA adapters and the
score head on a frozen base (or a 4-bit one: --bits 4, as QLoRA), under any accelerate strategy.

Launch (pick any file in accelerate_configs/, or your own `accelerate config` file):

    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/reward.py \\
        --model my-sft-model --dataset pairs.jsonl --output-dir outputs/reward

Each row of --dataset is a preference pair: a prompt, the reply to prefer (`chosen`) and the one to avoid
(`rejected`), as text or chat messages (docs/data.md, "Preference pairs"). The model is the causal model with its
LM head swapped for a score head (one output), read at each row's last token: what the family's
AutoModelForSequenceClassification computes, and what merged/ is saved as. With no --model / --dataset it trains
the bundled tiny model on the bundled pairs, also on a machine without GPUs (add `--num_processes 2
--mixed_precision no` to the launcher). A saved reward model scores GRPO's completions through
recipes/rewards.py's `reward_model`.

Writes to --output-dir: run.json (what ran), metrics.jsonl (one line per step and per evaluation, with TRL's
names: loss, accuracy, margin, mean_reward), checkpoints/step-N/ (resumable), adapter/ (the LoRA adapter and the
score head) and merged/ (always: AutoModelForSequenceClassification.from_pretrained).

Flags: --model --dataset --eval-dataset --columns --chat-template --output-dir --epochs --max-steps --batch-size
       --global-batch-size --grad-accum --lr --warmup-ratio --weight-decay --max-grad-norm --max-length --seed
       --eval-every --save-every --save-total-limit --resume --gradient-checkpointing --log-every --report-to
       --save-dtype --trust-remote-code --eval-on-start --no-eval-on-start
       --config (a YAML file of any of these flags)
Speed: --compile --no-compile --liger --attention --dataloader-workers
LoRA:  --lora-r --lora-alpha --lora-dropout --lora-targets --use-dora --use-rslora --merge --bits
Reward: --center-rewards-coefficient
Refused here: --packing --pipeline-stages --pipeline-schedule --pipeline-chunks, tensor and sequence parallel,
       --eval-tasks --eval-limit --eval-raw-prompts (a reward model writes no text to score)
"""

import math

import common.quiet  # noqa: F401  (first: silences library notices nobody can act on)
from common.launching import args as cli, quick_checks

if __name__ == "__main__":  # --help, and a refusal that needs no library, now: the libraries below take seconds to load
    quick_checks.refuse_before_loading("reward", __doc__)

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import get_cosine_schedule_with_warmup

from common.data import batches, preferences
from common.launching import deepspeed_config, preflight, settle
from common.model import modeling, score_head
from common.outputs import checkpoint, report
from common.outputs.runlog import RunLog
from common.training import runtime
from common.training.evaluation import evaluate_pairs


def row_rewards(model, batch, pad_token_id):
    """Each row's reward (the micro-batch's chosen sides, then its rejected sides), and a mixture of experts'
    router loss (None for other models): the score head's output at the row's last token that is not padding."""
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False)
    return (score_head.rewards_at_last_token(outputs.logits, batch["input_ids"], pad_token_id).float(),
            outputs.get("aux_loss"))


def pair_losses(rewards, margins, run):
    """The loss of each pair and the rewards of its two sides. Every path that trains or evaluates computes its
    pairs' loss here: edit it here.

    Bradley-Terry: -log sigmoid(chosen reward - rejected reward - the pair's margin), the chance the model gives
    the preference it was told, by at least the margin where the data gives one (a `margin` column; else 0);
    --center-rewards-coefficient adds that weight x (chosen + rejected reward)^2, which keeps the rewards near 0
    (TRL's center_rewards_coefficient)."""
    chosen, rejected = rewards.chunk(2)
    losses = -F.logsigmoid(chosen - rejected - margins)
    if run.center_rewards_coefficient:
        losses = losses + run.center_rewards_coefficient * (chosen + rejected) ** 2
    return losses, chosen.detach(), rejected.detach()


def score_pairs(model, batch, run, pad_token_id):
    """Per pair: its loss (with its graph), and its detached figures: [loss, chosen reward, rejected reward, 1 where
    the chosen side's reward is higher]; and the micro-batch's router loss (a mixture of experts'; else None)."""
    rewards, router_loss = row_rewards(model, batch, pad_token_id)
    losses, chosen, rejected = pair_losses(rewards, batch.get("margin", 0.0), run)
    figures = torch.stack([losses.detach(), chosen, rejected, (chosen > rejected).to(chosen.dtype)], 1)
    return losses, figures, router_loss


def parse_args():
    return cli.parse_args(cli.recipe_flags("reward", __doc__))


def main():
    # The run's settings, settled once (read-only from here); a launch that cannot work is refused here, in one
    # line, before the model loads. Settled as LoRA (adapters on a frozen base), or QLoRA with --bits.
    args = parse_args()
    run, launch = settle.settle_launch(args, recipe="qlora" if args.bits else "lora")
    accelerator = runtime.make_accelerator(run, launch)
    resume = checkpoint.resume_point(accelerator, run, launch)  # the checkpoint to continue, checked before loading
    set_seed(run.seed)

    # Pairs, before the model: each side rendered and tokenised as the SFT recipes tokenise a row (what the reward
    # model reads is what a policy's reply looks like). Pairs that cannot train are counted and dropped.
    modeling.ensure_default_model(run.model, accelerator)
    tokenizer = modeling.load_tokenizer(run.model, run.trust_remote_code, run.chat_template)
    train_set, eval_set, data_format = preferences.prepare_pairs(accelerator, tokenizer, run, launch)

    # Model: the frozen base in 16 bits where mixed precision allows (quantized as it loads with --bits), its LM
    # head swapped for the score head (score_head.py), trainable adapters on top; the score head trains whole.
    quantization = modeling.quantization_config(launch, run.bits) if run.bits else None
    model = modeling.load_model(run.model, accelerator, launch, frozen=True, quantization=quantization,
                                attention=run.attention, liger=run.liger, trust_remote_code=run.trust_remote_code)
    # A mixture of experts whose config asks for it (output_router_logits) also trains its router to spread
    # the tokens over the experts: transformers' load-balancing loss with this weight (0 for other models).
    router_weight = modeling.router_loss_weight(model)
    head_name = score_head.head_name(model)
    score_head.put_score_head(model, run.seed, launch.float_dtype(frozen=False))
    if quantization and not launch.shards_parameters:
        # Upcasts norms for stability; FSDP / ZeRO-3 need one dtype throughout, so they skip it.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if run.gradient_checkpointing:  # recompute every Nth layer's activations in the backward instead of keeping them
        modeling.checkpoint_activations(model, every_n_layers=run.gradient_checkpointing)
    lora_config = LoraConfig(
        r=run.lora_r,
        lora_alpha=run.lora_alpha,
        lora_dropout=run.lora_dropout,
        target_modules=cli.lora_targets(run.lora_targets),
        use_dora=run.use_dora,
        use_rslora=run.use_rslora,
        task_type="CAUSAL_LM",
        modules_to_save=[head_name],  # the score head: trained in full, saved with the adapter
    )
    model = get_peft_model(model, lora_config)
    modeling.seed_adapter(model, run.seed)  # the same first adapter whatever the strategy split
    modeling.keep_adapter_inputs_in_compute_dtype(model, launch)  # no float32 copy of each adapter's input

    # Batches: shuffled micro-batches of pairs, each one batch of rows (chosen sides, then rejected sides).
    collate = batches.PadPairs(tokenizer.pad_token_id)
    train_loader, eval_loader = batches.make_loaders(train_set, eval_set, collate, run.batch_size,
                                                  run.dataloader_workers)
    probe = next(iter(eval_loader))

    optimizer = torch.optim.AdamW(
        modeling.trained_parameter_groups(model), lr=run.lr, weight_decay=run.weight_decay, fused=True
    )
    steps_per_epoch = batches.steps_per_epoch(len(train_loader) // launch.data_parallel_size, run.grad_accum)
    total_steps = run.max_steps or math.ceil(run.epochs * steps_per_epoch)
    # compiled by default only where the planned steps repay compiling (a flag or a config file decides first)
    run = settle.settle_compile_steps(run, total_steps)
    if run.compile:
        modeling.compile_layers(model)  # the first steps are slower while each shape compiles
    if run.deepspeed_scheduler:
        scheduler = deepspeed_config.deepspeed_schedule(optimizer, run.deepspeed_scheduler, run, total_steps)
    else:
        scheduler = get_cosine_schedule_with_warmup(optimizer, int(run.warmup_ratio * total_steps), total_steps)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )
    parameters = list(model.parameters())  # after prepare (FSDP's shards); listed once, not walked each step
    pad = tokenizer.pad_token_id  # a row's reward is read at its last token that is not padding

    log = RunLog(accelerator, run, recipe="reward", launch=launch)
    start_step = checkpoint.resume_from(accelerator, resume, model, optimizer, None)
    # after the resume: a failed load changes nothing
    log.write_run_json(model, None, data_format, optimizer, total_steps, "the score head at each row's last token")

    def evaluate_now(step):  # the held-out figures (and --eval-tasks' scores) of the model as it is now
        log.log_eval(step, evaluate_pairs(accelerator, model, eval_loader,
                                          lambda batch: score_pairs(model, batch, run, pad)[1]))

    # The loop: one iteration = one optimizer step over grad_accum micro-batches on every rank.
    model.train()
    sync = runtime.StepSync(accelerator)  # the step's one all-reduce; SIGTERM / Ctrl-C stop at the end of a step
    log.start(start_step, total_steps)
    if run.eval_on_start and start_step == 0:  # a baseline, logged as step 0: what the steps then change
        with runtime.same_random_state():  # (it draws nothing the steps would: the same curve without it)
            evaluate_now(0)
    steps = batches.optimizer_steps(train_loader, run.grad_accum, start_step)
    epoch, micro_batches = next(steps)
    step_tokens = sync.count_tokens(micro_batches)  # the trained tokens of both sides (what tokens/s counts)
    # A step's loss is the mean over the pairs of the global batch: every micro-batch holds --batch-size pairs, on
    # every rank.
    step_pairs = run.batch_size * run.grad_accum * accelerator.num_processes
    for step in range(start_step + 1, total_steps + 1):
        step_loss, step_figures, step_router_loss = 0.0, 0.0, 0.0
        for batch in micro_batches:
            with accelerator.accumulate(model):
                losses, figures, router_loss = score_pairs(model, batch, run, pad)
                share = losses.sum() / step_pairs  # this micro-batch's share of the step's loss
                step_loss += share.detach()
                step_figures += figures[:, 1:].sum(0)  # summed over pairs: the two rewards, wins
                # The gradient of the step's loss: undo accelerate's division by grad_accum and the gradient
                # all-reduce's mean over ranks.
                objective = share * run.grad_accum * accelerator.num_processes
                if router_weight:  # the router's loss: its mean over micro-batches and ranks, as the backward scales it
                    objective = objective + router_weight * router_loss
                    step_router_loss += router_loss.detach()
                accelerator.backward(objective)
        grad_norm = accelerator.clip_grad_norm_(parameters, run.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

        # The step's one collective: the loss and the pairs' figures summed over all ranks, the stop flag,
        # and the next step's target tokens (its micro-batches are fetched now to travel along).
        next_epoch, next_batches = next(steps) if step < total_steps else (epoch, [])
        loss, next_tokens, stopping, (chosen, rejected, wins, router_sum) = sync.end_of_step(
            step_loss, next_batches, [*step_figures, step_router_loss])
        figures = {"accuracy": wins / step_pairs, "margin": (chosen - rejected) / step_pairs,  # TRL's names
                   "mean_reward": (chosen + rejected) / (2 * step_pairs)}
        router_mean = router_sum / (run.grad_accum * accelerator.num_processes) if router_weight else None
        if step == start_step + 1:  # a gather (every rank takes part): what each rank holds, into run.json
            log.record_ranks()
        log.log_step(step, epoch, loss, scheduler.get_last_lr()[0], grad_norm, int(step_tokens), router_mean,
                     figures=figures)
        if not math.isfinite(loss):  # stop before saving anything from a diverged model
            preflight.refuse(f"the loss became {loss} at step {step}; lower --lr, or check the data, and start in a "
                             "new --output-dir (a checkpoint here may already hold the update that diverged)")
        if step == total_steps or (run.eval_every and step % run.eval_every == 0):
            evaluate_now(step)
        if stopping or (run.save_every and step % run.save_every == 0):
            checkpoint.save_checkpoint(accelerator, run, launch, step, None)
        if stopping:
            log.close(f"stopped by {sync.signal_name} after step {step}; continue with --resume auto")
            return
        epoch, micro_batches, step_tokens = next_epoch, next_batches, next_tokens

    # Export: what the trained model computes (its score at every position), then the files that reproduce it:
    # the adapter with the score head, and merged/, the family's sequence classifier.
    checkpoint.save_probe(accelerator, model, None, probe, run.output_dir)
    adapter_dir, merged_dir = f"{run.output_dir}/adapter", f"{run.output_dir}/merged"
    checkpoint.save_adapter(accelerator, model, None, tokenizer, adapter_dir)
    checkpoint.merge_adapter(accelerator, run.model, adapter_dir, merged_dir, base_4bit=run.bits == 4,
                             dtype=run.save_dtype, reward=True)
    report.write_model_card(accelerator, run, "reward", "merged", [])
    log.close(f"done: {total_steps} steps; reward model saved to {merged_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
    runtime.exit_after_a_finished_run()  # a native thread can abort the interpreter's teardown (runtime.py)
