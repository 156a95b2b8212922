"""Online reinforcement learning (GRPO and its loss variants DAPO, Dr. GRPO, BNPO; RLOO) of LoRA adapters on a
frozen base (or a 4-bit one: --bits 4), with rewards you write in Python, under any accelerate strategy.

Launch (pick any file in accelerate_configs/, or your own `accelerate config` file):

    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/grpo.py \\
        --model my-sft-model --dataset prompts.jsonl --reward my_rewards.py:correct --output-dir outputs/grpo

Each row of --dataset is a prompt (`prompt`: text, or chat messages); its other columns (an `answer`, test
cases, ...) go to the reward functions. Each step samples --num-generations completions of each of its prompts
from the model as it is, scores them with the --reward functions (TRL's signature: fn(prompts, completions,
**columns) -> list[float | None]; recipes/rewards.py has examples), and trains each completion's tokens by its
advantage: how much better its reward is than its group's, the other completions of the same prompt. With no
--model / --dataset / --reward it trains the bundled tiny model on the bundled prompts with the exact-answer
reward, also on a machine without GPUs (add `--num_processes 2 --mixed_precision no` to the launcher).

Writes to --output-dir: run.json (what ran), metrics.jsonl (one line per step and per evaluation, with TRL's
names: loss, reward, reward_std, rewards/<function>/mean and /std, frac_reward_zero_std, completions/mean_length,
completions/clipped_ratio, kl, clip_ratio/region_mean), samples.jsonl (prompts, completions, rewards and
advantages every --samples-every steps), checkpoints/step-N/ (resumable), adapter/ (PeftModel.from_pretrained)
and, with --merge, merged/ (AutoModelForCausalLM.from_pretrained). Evaluation: each held-out prompt's greedy
completion scored by the rewards (eval_reward, eval_rewards/<function>/mean).

Flags: --model --dataset --eval-dataset --columns --chat-template --output-dir --epochs --max-steps --batch-size
       --global-batch-size --grad-accum --lr --warmup-ratio --weight-decay --max-grad-norm --max-length --seed
       --eval-every --save-every --save-total-limit --resume --gradient-checkpointing --log-every --report-to
       --save-dtype --trust-remote-code
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
import time

import common.quiet  # noqa: F401  (first: silences library notices nobody can act on)
from common.launching import args as cli

if __name__ == "__main__":  # --help answered now: the libraries below take seconds to load
    cli.answer_help("grpo", __doc__)

import torch
import torch.nn.functional as F
from accelerate.utils import gather_object, set_seed
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import get_cosine_schedule_with_warmup

from common import rewards
from common.data import prompts
from common.data.formats import IGNORE
from common.launching import deepspeed_config, preflight, settle
from common.model import loss_head, modeling
from common.outputs import checkpoint, report
from common.outputs.runlog import RunLog
from common.training import benchmarks, rollouts, runtime


def completion_logps(model, batch, head, temperature):
    """Each completion token's log-probability under `model` ([rows, completion tokens]; 0 on padding), from
    its logits over the sampling temperature (the distribution it was drawn from). `head`: the run's way to the
    logits (loss_head.py), a chunk of positions at a time. And a mixture of experts' router loss (else None)."""
    targets, positions = batch["labels"][:, 1:], batch["target_positions"]  # position t predicts token t + 1
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], use_cache=False, **head.forward_arguments(positions))
    logps = head.apply(lambda logits, targets: target_logps(logits / temperature, targets), outputs, targets,
                       positions)
    return logps, outputs.get("aux_loss")


def target_logps(logits, targets):
    """Each position's log-probability of its target token (0 where there is none), laid out like `targets`."""
    return -F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE,
                            reduction="none").view_as(targets)


def advantages_of(rewards_table, weights, group_size, run, kl_penalty=None):
    """Each completion's advantage, from the batch's rewards ([completions, functions], NaN where a function
    returned None; completions prompt by prompt, `group_size` each). The reward is the weighted sum of the
    functions'; a completion none applies to gets advantage 0 and stays out of its group's baseline.

    GRPO (every --loss but rloo): the reward minus its group's mean, over the group's spread (--scale-rewards
    group; batch: the whole batch's spread; none: not divided). RLOO: the reward (minus --beta x its KL to the
    reference, `kl_penalty`) minus the mean of the others in its group (leave-one-out)."""
    unscorable = rewards_table.isnan().all(1)
    reward = (rewards_table * torch.tensor(weights, dtype=rewards_table.dtype)).nansum(1)
    reward[unscorable] = math.nan
    grouped = reward.view(-1, group_size)
    if run.loss == "rloo":
        if kl_penalty is not None:
            grouped = (reward - run.beta * kl_penalty).view(-1, group_size)
        scorable = (~grouped.isnan()).sum(1, keepdim=True)
        baseline = (grouped.nansum(1, keepdim=True) - grouped) / (scorable - 1)
        advantages = (grouped - baseline).view(-1)
        if run.normalize_advantages:
            advantages = (advantages - advantages.nanmean()) / (nanstd(advantages) + 1e-4)
        return advantages.nan_to_num(0.0)
    advantages = (grouped - grouped.nanmean(1, keepdim=True)).view(-1)
    if run.scale_rewards == "group":
        advantages = advantages / (nanstd(grouped, dim=1).repeat_interleave(group_size) + 1e-4)
    elif run.scale_rewards == "batch":
        advantages = advantages / (nanstd(reward) + 1e-4)
    return advantages.nan_to_num(0.0)


def nanstd(values, dim=None):
    """The standard deviation over the values that are not NaN (with Bessel's correction, as torch.std)."""
    count = (~values.isnan()).sum(dim) if dim is not None else (~values.isnan()).sum()
    mean = values.nanmean(dim, keepdim=True) if dim is not None else values.nanmean()
    squares = ((values - mean) ** 2).nansum(dim) if dim is not None else ((values - mean) ** 2).nansum()
    return (squares / (count - 1)).sqrt()


def completion_losses(logps, old_logps, reference_logps, advantages, run):
    """The loss of each completion token ([rows, tokens]; with --loss rloo, of each completion: [rows]), and the
    figures of each: [which ratio was clipped, its KL to the reference]. Every path that trains computes its loss
    here: edit it here.

    The ratio of the policy to the one that sampled (1 at the first step on a batch: the gradient is then the
    advantage's), clipped to [1 - epsilon, 1 + epsilon_high] where that lowers the objective (PPO's pessimism);
    --beta adds the KL to the reference per token (k3, always >= 0), weighted by the ratio. RLOO clips one ratio per completion, of
    its whole log-probability, and has its KL in the reward instead (advantages_of)."""
    low, high = 1 - run.epsilon, 1 + (run.epsilon_high if run.epsilon_high is not None else run.epsilon)
    if run.loss == "rloo":
        logps, old_logps = logps.sum(1), old_logps.sum(1)  # (0 on padding)
    else:
        advantages = advantages[:, None]
    ratio = torch.exp(logps - old_logps)
    losses = -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    clipped = ((ratio < low) & (advantages < 0)) | ((ratio > high) & (advantages > 0))
    kl = torch.zeros_like(ratio)
    if run.beta and run.loss != "rloo":
        kl = torch.exp(reference_logps - logps) - (reference_logps - logps) - 1
        # times the ratio (1 in value on a fresh batch, not in gradient): the unbiased gradient of the reverse KL
        # (DeepSeek-V3.2; TRL's use_bias_correction_kl, on by default)
        losses = losses + run.beta * kl * ratio
    return losses, clipped.float(), kl.detach()


def share_of_step_loss(losses, mask, run, step_completions, step_tokens, micro_batches):
    """This micro-batch's share of the step's loss, as TRL normalises each --loss (the shares of every
    micro-batch on every rank sum to the step's loss). dapo: the token mean over the step's completions; grpo:
    each completion's token mean, averaged over the step's completions; dr_grpo: the token sum over completions x
    --max-completion-length; bnpo: each micro-batch's token mean, averaged over the step's micro-batches; rloo:
    the mean over the step's completions of each one's loss."""
    if run.loss == "rloo":
        return losses.sum() / step_completions
    if run.loss == "grpo":
        return ((losses * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / step_completions
    if run.loss == "dr_grpo":
        return (losses * mask).sum() / (step_completions * run.max_completion_length)
    if run.loss == "bnpo":
        return (losses * mask).sum() / mask.sum().clamp(min=1) / micro_batches
    return (losses * mask).sum() / max(step_tokens, 1)  # dapo


def parse_args():
    return cli.parse_args(cli.recipe_flags("grpo", __doc__))


def main():
    # The run's settings, settled once (read-only from here); a launch that cannot work is refused here, in one
    # line, before the model loads: the reward functions are imported now, from your files.
    args = parse_args()
    run, launch = settle.settle_launch(args, recipe="qlora" if args.bits else "lora")
    reward_functions = rewards.load_rewards(run.reward)
    weights = rewards.weights_of(run.reward_weights, reward_functions)
    accelerator = runtime.make_accelerator(run, launch)
    resume = checkpoint.resume_point(accelerator, run, launch)  # the checkpoint to continue, checked before loading
    set_seed(run.seed)

    # Prompts, before the model: each tokenised as the model will be asked it; every other column kept for the
    # rewards. A step's global batch holds --batch-size x --grad-accum x processes completions: whole groups of
    # --num-generations, of `prompts_per_step` prompts.
    modeling.ensure_default_model(run.model, accelerator)
    tokenizer = modeling.load_tokenizer(run.model, run.trust_remote_code, run.chat_template)
    train_set, eval_set, data_format = prompts.prepare_prompts(accelerator, tokenizer, run)
    chat = data_format == prompts.CHAT_PROMPTS
    step_completions = run.batch_size * run.grad_accum * launch.data_parallel_size
    prompts_per_step = step_completions // run.num_generations
    preflight.check_prompt_count(len(train_set), prompts_per_step, run)

    # Model: the frozen base in 16 bits where mixed precision allows (quantized as it loads with --bits),
    # trainable adapters on top.
    quantization = modeling.quantization_config(launch, run.bits) if run.bits else None
    model = modeling.load_model(run.model, accelerator, launch, frozen=True, quantization=quantization,
                                attention=run.attention, liger=run.liger, trust_remote_code=run.trust_remote_code)
    router_weight = modeling.router_loss_weight(model)  # a mixture of experts' load-balancing loss (else 0)
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
    )
    model = get_peft_model(model, lora_config)
    modeling.seed_adapter(model, run.seed)  # the same first adapter whatever the strategy split
    modeling.keep_adapter_inputs_in_compute_dtype(model, launch)  # no float32 copy of each adapter's input
    accelerator.print(f"reference: the base, i.e. this model with its adapters switched off, for --beta {run.beta}"
                      if run.beta else "reference: none (--beta 0: no KL term, no reference forward)")
    if run.compile:
        modeling.compile_layers(model)  # the first steps are slower while each shape compiles

    optimizer = torch.optim.AdamW(
        modeling.trained_parameter_groups(model), lr=run.lr, weight_decay=run.weight_decay, fused=True
    )
    batches_per_epoch = prompts.steps_per_epoch(len(train_set), prompts_per_step)
    total_steps = run.max_steps or math.ceil(run.epochs * batches_per_epoch) * run.num_iterations
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
    if start_step % run.num_iterations:
        accelerator.print(f"resume: step {start_step} is inside a batch of completions (--num-iterations "
                          f"{run.num_iterations}); its completions are sampled again from the model as resumed")

    def roll_out(step):
        """The generation batch that step `step` trains on: this rank's share of the batch's completions,
        sampled with the weights gathered once; their rewards on every rank; the advantages; the log-
        probabilities they were sampled with (needed where the model moves before they train: --num-iterations
        > 1) and the reference's (--beta); cut into --grad-accum micro-batches."""
        batch = (step - 1) // run.num_iterations
        epoch, batch_rows = prompts.step_prompts(len(train_set), prompts_per_step, batch + 1, run.seed)
        share = (accelerator.process_index * run.batch_size * run.grad_accum, run.batch_size * run.grad_accum)
        started = time.perf_counter()
        with rollouts.whole_weights(model, launch):  # every rank at once: a collective under FSDP / ZeRO-3
            completions = rollouts.sample_completions(accelerator, model, train_set, batch_rows, batch, run, tokenizer,
                                                      share, chat)
        sampling_s = time.perf_counter() - started
        scored = score_everywhere(completions, step)
        micro_batches = [rollouts.training_batch(completions, slice(start, start + run.batch_size),
                                                 run.mask_truncated_completions)
                         for start in range(0, len(completions.completion_ids), run.batch_size)]
        micro_batches = [{key: value.to(accelerator.device) for key, value in b.items()} for b in micro_batches]
        with torch.no_grad():
            for b in micro_batches:
                if run.num_iterations > 1 or (run.loss == "rloo" and run.beta):
                    b["old_logps"] = completion_logps(model, b, head, run.temperature)[0]
                if run.beta:
                    with modeling.adapters_off(accelerator.unwrap_model(model)):
                        b["reference_logps"] = completion_logps(model, b, head, run.temperature)[0]
        kl_penalty = None
        if run.loss == "rloo" and run.beta:  # RLOO's KL in the reward: each completion's sum of log-ratios
            local = torch.cat([((b["old_logps"] - b["reference_logps"]) * b["completion_mask"]).sum(1)
                               for b in micro_batches])
            kl_penalty = accelerator.gather(local).cpu().double()
        advantages = advantages_of(scored, weights, run.num_generations, run, kl_penalty)
        mine = advantages[share[0]:share[0] + share[1]].float()
        for index, b in enumerate(micro_batches):
            b["advantages"] = mine[index * run.batch_size:(index + 1) * run.batch_size].to(accelerator.device)
        lengths = accelerator.gather(torch.tensor([[len(ids), int(cut), sampling_s] for ids, cut in zip(
            completions.completion_ids, completions.truncated)], device=accelerator.device, dtype=torch.float64)).cpu()
        tokens = int(accelerator.reduce(sum(b["completion_mask"].sum() for b in micro_batches).to(torch.int64), "sum"))
        figures = reward_figures(scored, weights, advantages, lengths)
        return epoch, micro_batches, tokens, figures, completions, scored, advantages

    def score_everywhere(completions, step):
        """[batch's completions, functions] rewards, each rank scoring its own completions (the functions run
        in parallel), gathered to every rank. A function that fails on any rank stops every rank with its line,
        after the last finished step is saved."""
        try:
            table, problem = rewards.score(reward_functions, completions.prompts, completions.texts,
                                           {**completions.columns, "completion_ids": completions.completion_ids}), None
        except rewards.RewardProblem as error:
            table, problem = [[math.nan] * len(reward_functions)] * len(completions.texts), str(error)
        problems = [found for found in gather_object([problem]) if found]
        if problems:
            if step - 1 > start_step:  # nothing lost: the steps done so far, saved (the checkpoint is kept)
                checkpoint.save_checkpoint(accelerator, run, launch, step - 1, None)
            preflight.refuse(f"{problems[0]} (at step {step}; fix it, then continue with --resume auto)")
        return accelerator.gather(torch.tensor(table, dtype=torch.float64, device=accelerator.device)).cpu()

    def reward_figures(scored, weights, advantages, lengths):
        """The batch's reward figures, under TRL's names (every rank computes them from the gathered rewards)."""
        total = (scored * torch.tensor(weights, dtype=scored.dtype)).nansum(1)
        total[scored.isnan().all(1)] = math.nan
        grouped = total.view(-1, run.num_generations)
        figures = {"reward": total.nanmean().item(), "reward_std": nanstd(total).item(),
                   "frac_reward_zero_std": (nanstd(grouped, dim=1).nan_to_num(0.0) < 1e-8).double().mean().item()}
        for index, function in enumerate(reward_functions):
            figures[f"rewards/{function.name}/mean"] = scored[:, index].nanmean().item()
            figures[f"rewards/{function.name}/std"] = nanstd(scored[:, index]).item()
        figures.update({"completions/mean_length": lengths[:, 0].mean().item(),
                        "completions/min_length": lengths[:, 0].min().item(),
                        "completions/max_length": lengths[:, 0].max().item(),
                        "completions/clipped_ratio": lengths[:, 1].mean().item(),
                        # the slowest rank's sampling time, and the completion tokens all ranks drew in it
                        "generation/seconds": lengths[:, 2].max().item(),
                        "generation/tokens_per_s": lengths[:, 0].sum().item() / max(lengths[:, 2].max().item(), 1e-9)})
        return figures

    def write_samples(step, completions, scored, advantages):
        """The batch's prompts, completions, rewards and advantages, one line each, into samples.jsonl."""
        texts = [completions.prompts, completions.texts]
        gathered = gather_object([list(zip(*texts))])
        if accelerator.is_main_process:
            lines = [line for part in gathered for line in part]
            log.write_samples(step, [{"prompt": prompt, "completion": completion, "advantage": advantages[i].item(),
                                      "rewards": {f.name: (None if math.isnan(scored[i, j]) else scored[i, j].item())
                                                  for j, f in enumerate(reward_functions)}}
                                     for i, (prompt, completion) in enumerate(lines)])

    def evaluate():
        """Each held-out prompt's greedy completion, scored by the rewards: their means (each rank its share)."""
        mine = list(range(accelerator.process_index, len(eval_set), accelerator.num_processes))
        rows = eval_set.select(mine).to_list()
        stop_ids = rollouts.stop_tokens(tokenizer, accelerator.unwrap_model(model))
        chunk = run.batch_size * run.grad_accum
        most = -(-len(eval_set) // accelerator.num_processes)  # the rows of the rank with the most
        chunks = -(-most // chunk)
        ids = []
        with rollouts.whole_weights(model, launch):
            for index in range(chunks):  # the same count on every rank (a rank with fewer rows samples none)
                part = rows[index * chunk:(index + 1) * chunk]
                ids += rollouts.sample(accelerator, model, [row["prompt_ids"] for row in part], None,
                                       max_new_tokens=run.max_completion_length, stop_ids=stop_ids,
                                       pad_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": text}] for text in texts] if chat else texts
        columns = {name: [row[name] for row in rows] for name in eval_set.column_names
                   if name not in ("prompt", "prompt_ids")}
        columns["completion_ids"] = ids
        try:
            table = rewards.score(reward_functions, [row["prompt"] for row in rows], completions, columns)
        except rewards.RewardProblem as error:
            preflight.refuse(f"{error} (scoring the held-out prompts)")
        sums = torch.tensor([[sum(0.0 if math.isnan(v) else v for v in column), sum(not math.isnan(v) for v in column)]
                             for column in zip(*table)] if table else [[0.0, 0.0]] * len(reward_functions),
                            dtype=torch.float64, device=accelerator.device)
        sums = accelerator.reduce(sums, "sum").cpu()
        means = {f"eval_rewards/{f.name}/mean": (sums[j, 0] / sums[j, 1].clamp(min=1)).item()
                 for j, f in enumerate(reward_functions)}
        samples = [{"prompt": tokenizer.decode(row["prompt_ids"], skip_special_tokens=True), "generated": text,
                    "reference": str(row.get("answer", ""))} for row, text in zip(rows[:3], texts[:3])]
        return {"eval_reward": sum(w * means[f"eval_rewards/{f.name}/mean"] for w, f in zip(weights, reward_functions)),
                **means}, samples

    # The loop: one iteration = one optimizer step over grad_accum micro-batches on every rank.
    model.train()
    sync = runtime.StepSync(accelerator, counts_tokens=False)  # the step's one all-reduce; SIGTERM / Ctrl-C stop cleanly
    log.start(start_step, total_steps)
    micro_batches, samples, learned = None, [], start_step > 0
    if run.eval_every and start_step == 0:  # where the model starts: the baseline its rewards are compared with
        log.log_eval(0, evaluate()[0])
    for step in range(start_step + 1, total_steps + 1):
        if micro_batches is None or (step - 1) % run.num_iterations == 0:  # a new batch of completions
            epoch, micro_batches, step_tokens, figures, completions, scored, advantages = roll_out(step)
            if run.samples_every and step % run.samples_every == 0:
                write_samples(step, completions, scored, advantages)
        step_loss, step_sums, step_router_loss = 0.0, torch.zeros(2, dtype=torch.float64), 0.0
        for batch in micro_batches:
            with accelerator.accumulate(model):
                logps, router_loss = completion_logps(model, batch, head, run.temperature)
                old_logps = batch.get("old_logps", logps.detach())  # the sampling policy's: this one, unless it moved
                losses, clipped, kl = completion_losses(logps, old_logps, batch.get("reference_logps"),
                                                        batch["advantages"], run)
                mask = batch["completion_mask"]
                share = share_of_step_loss(losses, mask, run, step_completions, step_tokens,
                                           run.grad_accum * launch.data_parallel_size)
                step_loss += share.detach()
                # figures summed over the trained tokens (rloo: over completions): clipped ratios, KL
                weight = mask if run.loss != "rloo" else torch.ones_like(clipped)
                step_sums += torch.stack([(clipped * weight).sum(), (kl * weight).sum()]).double().cpu()
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

        # The step's one collective: the loss and the figures summed over all ranks, and the stop flag.
        summed_loss, _, stopping, (clipped_sum, kl_sum, router_sum) = sync.end_of_step(
            step_loss, [], [*step_sums.tolist(), step_router_loss])
        learned = learned or figures["frac_reward_zero_std"] < 1  # some group had a better completion than others
        counted = step_tokens if run.loss != "rloo" else step_completions
        router_mean = router_sum / (run.grad_accum * accelerator.num_processes) if router_weight else None
        if step == start_step + 1:  # a gather (every rank takes part): what each rank holds, into run.json
            log.record_ranks()
        log.log_step(step, epoch, summed_loss, scheduler.get_last_lr()[0], grad_norm, step_tokens, router_mean,
                     figures={**figures, "clip_ratio/region_mean": clipped_sum / max(counted, 1),
                              **({"kl": kl_sum / max(counted, 1)} if run.beta and run.loss != "rloo" else {})},
                     shown=("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "kl",
                            "generation/tokens_per_s"))
        if not math.isfinite(summed_loss):  # stop before saving anything from a diverged model
            preflight.refuse(f"the loss became {summed_loss} at step {step}; lower --lr, or check the rewards, and "
                             "start in a new --output-dir (a checkpoint here may already hold the update that diverged)")
        if step == total_steps or (run.eval_every and step % run.eval_every == 0):
            metrics, samples = evaluate()
            log.log_eval(step, metrics)
            if run.eval_tasks:  # lm-eval's tasks on the model as the launch holds it, each rank its share
                log.log_benchmarks(step, benchmarks.score_run(accelerator, launch, run, model, tokenizer, data_format))
        if stopping or (run.save_every and step % run.save_every == 0):
            checkpoint.save_checkpoint(accelerator, run, launch, step, None)
        if stopping:
            log.close(f"stopped by {sync.signal_name} after step {step}; continue with --resume auto")
            return

    # Export: the adapter, and the model card with the held-out prompts' greedy completions.
    if not learned:
        log.say("grpo: every group's completions tied on reward at every step, so no completion was better than "
                "another and the adapter did not move; start from a model that sometimes earns the reward (an SFT "
                "adapter as --model), or add a reward with partial credit (recipes/rewards.py:answer_similarity)")
    probe = rollouts.probe_batch([row["prompt_ids"] for row in eval_set.select(range(min(4, len(eval_set))))],
                                 tokenizer.pad_token_id)
    checkpoint.save_probe(accelerator, model, None, probe, run.output_dir)  # what a reload must compute
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
