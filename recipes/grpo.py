"""Online reinforcement learning (GRPO and its loss variants DAPO, Dr. GRPO, BNPO; RLOO) of LoRA adapters on a
frozen base (or a 4-bit one: --bits 4), with rewards you write in Python, under any accelerate strategy.

Launch (pick any file in accelerate_configs/, or your own `accelerate config` file):

    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/grpo.py \\
        --model my-sft-model --dataset prompts.jsonl --reward my_rewards.py:correct --output-dir outputs/grpo

Each row of --dataset is a prompt (`prompt`: text or chat messages; its other columns go to the rewards). Each
step samples --num-generations completions of each of its prompts from the model as it is, scores them with the
--reward functions (TRL's signature: fn(prompts, completions, **columns) -> list[float | None]; examples in
recipes/rewards.py), and trains each completion's tokens by its advantage: how much better its reward is than its
group's (the other completions of its prompt). With no --model / --dataset / --reward it trains the bundled tiny
model on the bundled prompts, also without GPUs (add `--num_processes 2 --mixed_precision no` to the launcher).

Writes to --output-dir: run.json, metrics.jsonl (TRL's names: docs/grpo.md), samples.jsonl (completions, rewards,
advantages every --samples-every steps), checkpoints/step-N/ (resumable), adapter/ (PeftModel.from_pretrained)
and, with --merge, merged/. Evaluation: each held-out prompt's greedy completion scored by the rewards.

Flags: --model --dataset --eval-dataset --columns --chat-template --output-dir --epochs --max-steps --batch-size
       --global-batch-size --grad-accum --lr --warmup-ratio --weight-decay --max-grad-norm --max-length --seed
       --eval-every --save-every --save-total-limit --resume --gradient-checkpointing --log-every --report-to
       --save-dtype --trust-remote-code --eval-on-start --no-eval-on-start
       --config (a YAML file of any of these flags)
Speed: --compile --no-compile --liger --attention --dataloader-workers
Benchmarks: --eval-tasks --eval-limit --eval-raw-prompts (lm-evaluation-harness tasks, scored where the eval runs)
LoRA:  --lora-r --lora-alpha --lora-dropout --lora-targets --use-dora --use-rslora --merge --bits
GRPO:  --reward --reward-weights --num-generations --max-completion-length --mask-truncated-completions
       --temperature --top-p --top-k --loss (dapo, grpo, dr_grpo, bnpo, rloo) --scale-rewards
       --normalize-advantages --beta --epsilon --epsilon-high --num-iterations --samples-every
--batch-size and --global-batch-size count completions (--num-generations of each prompt).
Refused here: --packing --pipeline-stages --pipeline-schedule --pipeline-chunks, tensor and sequence parallel
"""

import math

import common.quiet  # noqa: F401  (first: silences library notices nobody can act on)
from common.launching import args as cli, quick_checks

if __name__ == "__main__":  # --help, and a refusal that needs no library, now: the libraries below take seconds to load
    quick_checks.refuse_before_loading("grpo", __doc__)

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import get_cosine_schedule_with_warmup

from common import rewards
from common.data import prompts
from common.data.formats import IGNORE
from common.launching import deepspeed_config, preflight, settle
from common.model import loss_head, modeling
from common.outputs import checkpoint, report
from common.outputs.runlog import RunLog
from common.training import benchmarks, online, runtime


def completion_logps(model, batch, head, temperature):
    """Each completion token's log-probability ([rows, completion tokens]; 0 on padding) from its logits over the
    sampling temperature (`head`: loss_head.py), and a mixture of experts' router loss (else None)."""
    targets, positions = batch["labels"][:, 1:], batch["target_positions"]  # position t predicts token t + 1
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], use_cache=False, **head.forward_arguments(positions))
    logps = head.apply(lambda logits, labels: target_logps(logits / temperature, labels), outputs, targets, positions)
    return logps, outputs.get("aux_loss")


def target_logps(logits, targets):
    """Each position's log-probability of its target token (0 where there is none), laid out like `targets`."""
    return -F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE,
                            reduction="none").view_as(targets)


def advantages_of(rewards_table, weights, group_size, run, kl_penalty=None):
    """Each completion's advantage, from the batch's rewards ([completions, functions], NaN where a function
    returned None; `group_size` completions of each prompt in turn). The reward is the weighted sum of the
    functions'; a completion none applies to gets advantage 0 and stays out of its group's baseline.
    GRPO (every --loss but rloo): the reward minus its group's mean, over the group's spread (--scale-rewards
    group; batch: the whole batch's spread; none: not divided). RLOO: the reward (minus --beta x its KL to the
    reference, `kl_penalty`) minus the mean of the others in its group (leave-one-out)."""
    reward = online.weighted_total(rewards_table, weights)
    grouped = reward.view(-1, group_size)
    if run.loss == "rloo":
        if kl_penalty is not None:
            grouped = (reward - run.beta * kl_penalty).view(-1, group_size)
        scorable = (~grouped.isnan()).sum(1, keepdim=True)
        baseline = (grouped.nansum(1, keepdim=True) - grouped) / (scorable - 1)
        advantages = (grouped - baseline).view(-1)
        if run.normalize_advantages:
            advantages = (advantages - advantages.nanmean()) / (online.nanstd(advantages) + 1e-4)
        return advantages.nan_to_num(0.0)
    advantages = (grouped - grouped.nanmean(1, keepdim=True)).view(-1)
    if run.scale_rewards == "group":
        advantages = advantages / (online.nanstd(grouped, dim=1).repeat_interleave(group_size) + 1e-4)
    elif run.scale_rewards == "batch":
        advantages = advantages / (online.nanstd(reward) + 1e-4)
    return advantages.nan_to_num(0.0)


def completion_losses(logps, old_logps, reference_logps, advantages, mask, run):
    """The loss of each completion token ([rows, tokens]; --loss rloo: of each completion, [rows]) and its figures:
    [which ratio was clipped, its KL to the reference as the loss weighs it]. Every path that trains computes its
    loss here: edit it here. The ratio of the policy to the one that sampled (1 at a batch's first step: the
    gradient is then the advantage's), clipped to [1 - epsilon, 1 + epsilon_high] where that lowers the objective
    (PPO's pessimism); --beta adds the KL to the reference per token (k3, always >= 0), weighted by the ratio. RLOO
    clips one ratio per completion, of its whole log-probability, and has its KL in the reward (advantages_of)."""
    low, high = 1 - run.epsilon, 1 + (run.epsilon_high if run.epsilon_high is not None else run.epsilon)
    if run.loss == "rloo":
        logps, old_logps = (logps * mask).sum(1), (old_logps * mask).sum(1)  # (its tokens that train)
    else:
        advantages = advantages[:, None]
    ratio = torch.exp(logps - old_logps)
    losses = -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    clipped = ((ratio < low) & (advantages < 0)) | ((ratio > high) & (advantages > 0))
    kl = torch.zeros_like(ratio)
    if run.beta and run.loss != "rloo":
        kl = torch.exp(reference_logps - logps) - (reference_logps - logps) - 1
        # x the ratio (1 in value on a fresh batch, not in gradient): the reverse KL's unbiased gradient
        losses = losses + run.beta * kl * ratio  # (DeepSeek-V3.2; TRL's use_bias_correction_kl, on by default)
    return losses, clipped.float(), (kl * ratio).detach()


def share_of_step_loss(losses, mask, run, step_completions, step_tokens, micro_batches):
    """This micro-batch's share of the step's loss, as TRL normalises each --loss (the shares of every micro-batch
    on every rank sum to the step's loss). dapo: the token mean over the step's completions; grpo: each completion's
    token mean, averaged over them; dr_grpo: the token sum over completions x --max-completion-length; bnpo: each
    micro-batch's token mean, averaged over the step's micro-batches; rloo: each completion's loss, averaged."""
    if run.loss == "rloo":
        return losses.sum() / step_completions
    if run.loss == "grpo":
        return ((losses * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / step_completions
    if run.loss == "dr_grpo":
        return (losses * mask).sum() / (step_completions * run.max_completion_length)
    if run.loss == "bnpo":
        return (losses * mask).sum() / mask.sum().clamp(min=1) / micro_batches
    return (losses * mask).sum() / max(step_tokens, 1)  # dapo


def main():
    # The run's settings, settled once (read-only from here); a launch that cannot work is refused here, in one
    # line, before the model loads: the reward functions are imported now, from your files.
    args = cli.parse_args(cli.recipe_flags("grpo", __doc__))
    run, launch = settle.settle_launch(args, recipe="qlora" if args.bits else "lora")
    reward_functions = rewards.load_rewards(run.reward)
    weights = rewards.weights_of(run.reward_weights, reward_functions)
    accelerator = runtime.make_accelerator(run, launch)
    resume = checkpoint.resume_point(accelerator, run, launch)  # the checkpoint to continue, checked before loading
    set_seed(run.seed)

    # Prompts, before the model, tokenised as the model will be asked them (other columns kept for the rewards).
    modeling.ensure_default_model(run.model, accelerator)
    tokenizer = modeling.load_tokenizer(run.model, run.trust_remote_code, run.chat_template)
    train_set, eval_set, data_format = prompts.prepare_prompts(accelerator, tokenizer, run)
    step_completions = run.batch_size * run.grad_accum * launch.data_parallel_size  # whole groups of each prompt's
    prompts_per_step = step_completions // run.num_generations
    preflight.check_prompt_count(len(train_set), prompts_per_step, run)

    # Model: the frozen base in 16 bits where mixed precision allows (quantized with --bits), adapters on top.
    quantization = modeling.quantization_config(launch, run.bits) if run.bits else None
    model = modeling.load_model(run.model, accelerator, launch, frozen=True, quantization=quantization,
                                attention=run.attention, liger=run.liger, trust_remote_code=run.trust_remote_code)
    router_weight = modeling.router_loss_weight(model)  # a mixture of experts' load-balancing loss (else 0)
    if quantization and not launch.shards_parameters:  # upcasts norms; FSDP / ZeRO-3 need one dtype throughout
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if run.gradient_checkpointing:  # recompute every Nth layer's activations in the backward instead of keeping them
        modeling.checkpoint_activations(model, every_n_layers=run.gradient_checkpointing)
    lora_config = LoraConfig(r=run.lora_r, lora_alpha=run.lora_alpha, lora_dropout=run.lora_dropout,
                             target_modules=cli.lora_targets(run.lora_targets), use_dora=run.use_dora,
                             use_rslora=run.use_rslora, task_type="CAUSAL_LM")
    model = get_peft_model(model, lora_config)
    modeling.seed_adapter(model, run.seed)  # the same first adapter whatever the strategy split
    modeling.keep_adapter_inputs_in_compute_dtype(model, launch)  # no float32 copy of each adapter's input
    accelerator.print(f"reference: the base, i.e. this model with its adapters switched off, for --beta {run.beta}"
                      if run.beta else "reference: none (--beta 0: no KL term, no reference forward)")

    optimizer = torch.optim.AdamW(modeling.trained_parameter_groups(model), lr=run.lr, weight_decay=run.weight_decay,
                                  fused=True)
    batches_per_epoch = prompts.steps_per_epoch(len(train_set), prompts_per_step)
    total_steps = run.max_steps or math.ceil(run.epochs * batches_per_epoch) * run.num_iterations
    # compiled by default only where the planned steps repay compiling (a flag or a config file decides first)
    run = settle.settle_compile_steps(run, total_steps)
    if run.compile:
        modeling.compile_layers(model)  # the first steps are slower while each shape compiles
    if run.deepspeed_scheduler:
        scheduler = deepspeed_config.deepspeed_schedule(optimizer, run.deepspeed_scheduler, run, total_steps)
    else:
        scheduler = get_cosine_schedule_with_warmup(optimizer, int(run.warmup_ratio * total_steps), total_steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    parameters = list(model.parameters())  # after prepare (FSDP's shards); listed once, not walked each step
    head = loss_head.settle(accelerator, model)  # the log-probabilities' way to the logits (loss_head.py)

    log = RunLog(accelerator, run, recipe="grpo", launch=launch)
    start_step = checkpoint.resume_from(accelerator, resume, model, optimizer, None)
    log.write_run_json(model, None, data_format, optimizer, total_steps, head.description)
    # Each step's completions sampled and scored (online.py), or the batch a checkpoint taken inside it kept
    sampling = online.Sampling(accelerator, model, launch, run, tokenizer, reward_functions, weights, data_format,
                               train_set, eval_set, prompts_per_step, start_step,
                               checkpoint.read_kept(resume, online.ROLLOUT_FILE))

    # The loop: one iteration = one optimizer step over grad_accum micro-batches on every rank.
    model.train()
    sync = runtime.StepSync(accelerator, counts_tokens=False)  # the step's one all-reduce; SIGTERM / Ctrl-C stop cleanly
    log.start(start_step, total_steps)
    rollout, samples, learned = None, [], start_step > 0
    if run.eval_on_start and start_step == 0:  # where the model starts: the baseline its rewards are compared with
        log.log_eval(0, sampling.evaluate()[0])
    for step in range(start_step + 1, total_steps + 1):
        if rollout is None or (step - 1) % run.num_iterations == 0:  # a new batch of completions
            rollout = sampling.batch(step)
            if rollout.problem:  # a reward failed on some rank: every rank stops with its line, nothing lost
                if step - 1 > start_step:
                    checkpoint.save_checkpoint(accelerator, run, launch, step - 1, None)
                preflight.refuse(f"{rollout.problem} (at step {step}; fix it, then continue with --resume auto)")
            with torch.no_grad():  # (a batch a checkpoint kept has them, as sampled)
                for b in rollout.micro_batches if rollout.fresh else []:
                    # the sampling policy's, where the model moves before they train (--num-iterations > 1); RLOO's KL
                    if run.num_iterations > 1 or (run.loss == "rloo" and run.beta):
                        b["old_logps"] = completion_logps(model, b, head, run.temperature)[0]
                    if run.beta:  # the reference: the base, i.e. this model with its adapters switched off
                        with modeling.adapters_off(accelerator.unwrap_model(model)):
                            b["reference_logps"] = completion_logps(model, b, head, run.temperature)[0]
            kl_penalty = None
            if run.loss == "rloo" and run.beta:  # RLOO's KL is in the reward: each completion's summed log-ratio
                kl_penalty = online.completion_sums(
                    accelerator, rollout, lambda b: (b["old_logps"] - b["reference_logps"]) * b["completion_mask"])
            advantages = advantages_of(rollout.rewards, weights, run.num_generations, run, kl_penalty)
            online.hand_out(advantages, rollout, run.batch_size)
            if run.samples_every and step % run.samples_every == 0 and (step - 1) % run.num_iterations == 0:
                lines = sampling.sample_lines(rollout, advantages)  # (a gather: every rank)
                if accelerator.is_main_process:
                    log.write_samples(step, lines)
        step_loss, step_sums, step_router_loss = 0.0, torch.zeros(2, dtype=torch.float64), 0.0
        for batch in rollout.micro_batches:
            with accelerator.accumulate(model):
                logps, router_loss = completion_logps(model, batch, head, run.temperature)
                old_logps = batch.get("old_logps", logps.detach())  # the sampling policy's: this one, unless it moved
                mask = batch["completion_mask"]
                losses, clipped, kl = completion_losses(logps, old_logps, batch.get("reference_logps"),
                                                        batch["advantages"], mask, run)
                share = share_of_step_loss(losses, mask, run, step_completions, rollout.tokens,
                                           run.grad_accum * launch.data_parallel_size)
                step_loss += share.detach()
                # figures summed over the trained tokens (rloo: over completions): clipped ratios, KL
                weight = mask if run.loss != "rloo" else torch.ones_like(clipped)
                step_sums += torch.stack([(clipped * weight).sum(), (kl * weight).sum()]).double().cpu()
                # the step's gradient: undo accelerate's division by grad_accum and the all-reduce's mean over ranks
                objective = share * run.grad_accum * accelerator.num_processes
                if router_weight:  # the router's loss: its mean over micro-batches and ranks, as the backward scales it
                    objective = objective + router_weight * router_loss
                    step_router_loss += router_loss.detach()
                accelerator.backward(objective)
        grad_norm = accelerator.clip_grad_norm_(parameters, run.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

        # The step's one collective: the loss and the figures summed over all ranks, and the stop flag.
        summed_loss, _, stopping, (clipped_sum, kl_sum, router_sum) = sync.end_of_step(
            step_loss, [], [*step_sums.tolist(), step_router_loss])
        learned = learned or rollout.figures["frac_reward_zero_std"] < 1  # some group's rewards differed
        counted = max(rollout.tokens if run.loss != "rloo" else step_completions, 1)
        router_mean = router_sum / (run.grad_accum * accelerator.num_processes) if router_weight else None
        if step == start_step + 1:  # a gather (every rank takes part): what each rank holds, into run.json
            log.record_ranks()
        log.log_step(step, rollout.epoch, summed_loss, scheduler.get_last_lr()[0], grad_norm, rollout.tokens,
                     router_mean, figures={**rollout.figures, "clip_ratio/region_mean": clipped_sum / counted,
                                           **({"kl": kl_sum / counted} if run.beta and run.loss != "rloo" else {})},
                     shown=online.SHOWN_FIGURES)
        if not math.isfinite(summed_loss):  # stop before saving anything from a diverged model
            preflight.refuse(f"the loss became {summed_loss} at step {step}; lower --lr, or check the rewards, and "
                             "start in a new --output-dir (a checkpoint here may already hold the update that diverged)")
        if step == total_steps or (run.eval_every and step % run.eval_every == 0):
            metrics, samples = sampling.evaluate()  # each held-out prompt's greedy completion, scored
            log.log_eval(step, metrics)
            if run.eval_tasks:  # lm-eval's tasks on the model as the launch holds it, each rank its share
                log.log_benchmarks(step, benchmarks.score_run(accelerator, launch, run, model, tokenizer, data_format))
        if stopping or (run.save_every and step % run.save_every == 0):
            checkpoint.save_checkpoint(accelerator, run, launch, step, None, sampling.kept_files(rollout, step))
        if stopping:
            log.close(f"stopped by {sync.signal_name} after step {step}; continue with --resume auto")
            return

    # Export: the adapter, and the model card with the held-out prompts' greedy completions.
    if not learned:
        log.say(online.nothing_learned("grpo", "adapter"))
    checkpoint.save_probe(accelerator, model, None, sampling.probe(), run.output_dir)  # what a reload must compute
    adapter_dir = f"{run.output_dir}/adapter"
    checkpoint.save_adapter(accelerator, model, None, tokenizer, adapter_dir, moved=learned)
    if run.merge:
        checkpoint.merge_adapter(accelerator, run.model, adapter_dir, f"{run.output_dir}/merged",
                                 base_4bit=run.bits == 4, dtype=run.save_dtype)
    report.write_model_card(accelerator, run, "grpo", "adapter", samples)
    log.close(f"done: {total_steps} steps; adapter saved to {adapter_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
    runtime.exit_after_a_finished_run()  # a native thread can abort the interpreter's teardown (runtime.py)
