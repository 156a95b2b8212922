"""Preference tuning (DPO, IPO, SimPO, ORPO) of LoRA adapters on a frozen base (or a 4-bit one: --bits 4, as QLoRA),
under any accelerate strategy.

Launch (pick any file in accelerate_configs/, or your own `accelerate config` file):

    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/dpo.py \\
        --model my-sft-model --dataset pairs.jsonl --output-dir outputs/dpo

Each row of --dataset is a preference pair: a prompt, the reply to prefer (`chosen`) and the one to avoid
(`rejected`), as text or chat messages (docs/data.md, "Preference pairs"). The reference model is the
base itself: the same model with its adapters switched off, so it costs a forward, not a second copy.
With no --model / --dataset it trains the bundled tiny model on the bundled pairs, also on a machine
without GPUs (add `--num_processes 2 --mixed_precision no` to the launcher).

Writes to --output-dir: run.json (what ran), metrics.jsonl (one line per step and per evaluation, with
TRL's names: loss, rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
logps/rejected), checkpoints/step-N/ (resumable), adapter/ (PeftModel.from_pretrained) and, with --merge,
merged/ (AutoModelForCausalLM.from_pretrained).

Flags: --model --dataset --eval-dataset --columns --chat-template --output-dir --epochs --max-steps --batch-size
       --global-batch-size --grad-accum --lr --warmup-ratio --weight-decay --max-grad-norm --max-length --seed
       --eval-every --save-every --save-total-limit --resume --gradient-checkpointing --log-every --report-to
       --save-dtype --trust-remote-code --eval-on-start --no-eval-on-start
       --config (a YAML file of any of these flags)
Speed: --compile --no-compile --liger --attention --dataloader-workers
Benchmarks: --eval-tasks --eval-limit --eval-raw-prompts (lm-evaluation-harness tasks, scored where the eval runs)
LoRA:  --lora-r --lora-alpha --lora-dropout --lora-targets --use-dora --use-rslora --merge --bits
Preference: --loss (sigmoid, ipo, simpo, orpo) --beta --simpo-gamma
Refused here (not for pairs yet): --packing --pipeline-stages --pipeline-schedule --pipeline-chunks
"""

import math

import common.quiet  # noqa: F401  (first: silences library notices nobody can act on)
from common.launching import args as cli, quick_checks

if __name__ == "__main__":  # --help, and a refusal that needs no library, now: the libraries below take seconds to load
    quick_checks.refuse_before_loading("dpo", __doc__)

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import get_cosine_schedule_with_warmup

from common.data import batches, images, preferences
from common.data.formats import IGNORE
from common.launching import deepspeed_config, preflight, settle
from common.model import loss_head, modeling, processors
from common.outputs import checkpoint, report
from common.outputs.runlog import RunLog
from common.training import benchmarks, runtime
from common.training.evaluation import evaluate_pairs


def sequence_logps(accelerator, model, batch, head):
    """Each row's log-probability of its target tokens (their sum: the probability of the whole reply),
    how many target tokens it has, ORPO's SFT targets' log-probability (`sft_labels`: the chosen rows' every
    token, summed over this rank's rows; else None), and a mixture of experts' router loss (None for other
    models). Rows are a micro-batch's chosen sides, then its rejected sides. `head`: the run's way to the logits
    (loss_head.py), only where some row has a target and a chunk of positions at a time."""
    labels, positions = batch["labels"][:, 1:], batch["target_positions"]  # position t predicts token t + 1
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                    position_ids=batch.get("position_ids"), **images.model_inputs(batch),  # pixels: image pairs
                    use_cache=False, **head.forward_arguments(positions))
    token_logps = head.apply(target_logps, outputs, batches.trained_targets(batch), positions)
    sft_logps = None
    if "sft_labels" in batch:  # ORPO: the chosen rows' prompts are scored too, for its SFT term
        at = positions.to(labels.device)
        sft_logps = (token_logps * (batch["sft_labels"][:, 1:].index_select(1, at) != IGNORE)).sum()
        token_logps = token_logps * (labels.index_select(1, at) != IGNORE)  # the replies' alone, for the pairs
    # Under sequence parallel each rank holds a slice of every row: the sums are its group's (runtime.py).
    logps = runtime.whole_row_sums(accelerator, model, token_logps.sum(1))
    tokens = runtime.whole_row_sums(accelerator, model, (labels != IGNORE).sum(1).to(token_logps.device))
    return logps, tokens, sft_logps, outputs.get("aux_loss")


def target_logps(logits, targets):
    """Each position's log-probability of its target token (0 on prompt and padding), laid out like `targets`."""
    return -F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE,
                            reduction="none").view_as(targets)


def pair_losses(logps, reference_logps, tokens, run):
    """The loss of each pair, the reward of each side (what the logs call rewards/chosen and
    rewards/rejected), and the loss's own figures by name (ORPO's log-odds). Every path that trains or evaluates
    computes its pairs' loss here: edit it here (ORPO's SFT term is the training loop's).

    sigmoid (DPO): -log sigmoid(beta x how much more the policy raised the chosen reply's log-probability
    over the reference's than the rejected one's). ipo: the same log-ratios per target token, pulled to a
    margin of 1 / (2 beta) by a squared loss. simpo: no reference; per-token log-probabilities, a margin of
    --simpo-gamma. orpo: no reference; -beta x log sigmoid of the log-odds ratio of the per-token
    log-probabilities (its SFT term, the chosen rows' negative log-likelihood, is added in the loop)."""
    chosen, rejected = logps.chunk(2)
    chosen_tokens, rejected_tokens = tokens.chunk(2)
    if run.loss in cli.REFERENCE_FREE_LOSSES:
        chosen_score, rejected_score = chosen / chosen_tokens, rejected / rejected_tokens
        if run.loss == "simpo":
            losses = -F.logsigmoid(run.beta * (chosen_score - rejected_score) - run.simpo_gamma)
            return losses, run.beta * chosen_score.detach(), run.beta * rejected_score.detach(), {}
        # the odds p / (1 - p) of each side's mean token probability p, chosen over rejected, in log space
        log_odds = ((chosen_score - rejected_score)
                    - (torch.log1p(-chosen_score.exp()) - torch.log1p(-rejected_score.exp())))
        log_odds_ratio = F.logsigmoid(log_odds)
        return (-run.beta * log_odds_ratio, run.beta * chosen_score.detach(), run.beta * rejected_score.detach(),
                {"log_odds_ratio": log_odds_ratio.detach(), "log_odds_chosen": log_odds.detach()})
    reference_chosen, reference_rejected = reference_logps.chunk(2)
    chosen_ratio, rejected_ratio = chosen - reference_chosen, rejected - reference_rejected
    if run.loss == "sigmoid":
        losses = -F.logsigmoid(run.beta * (chosen_ratio - rejected_ratio))
    else:  # ipo
        losses = (chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens - 1 / (2 * run.beta)) ** 2
    return losses, run.beta * chosen_ratio.detach(), run.beta * rejected_ratio.detach(), {}


def score_pairs(accelerator, model, batch, run, head):
    """Per pair: its loss (with its graph), and its detached figures: [loss, chosen reward, rejected
    reward, chosen log-probability, rejected log-probability, 1 where the chosen side's reward is higher, then the
    loss's own figures (ORPO's)]; ORPO's SFT targets' log-probability (else None); and the micro-batch's router loss
    (a mixture of experts'; else None)."""
    reference_logps = None
    if run.loss not in cli.REFERENCE_FREE_LOSSES:  # the reference: the base, i.e. this model with its adapters off
        with torch.no_grad(), modeling.adapters_off(accelerator.unwrap_model(model)):
            reference_logps = sequence_logps(accelerator, model, batch, head)[0]
    logps, tokens, sft_logps, router_loss = sequence_logps(accelerator, model, batch, head)
    losses, chosen_rewards, rejected_rewards, more = pair_losses(logps, reference_logps, tokens, run)
    chosen_logps, rejected_logps = logps.detach().chunk(2)
    won = (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype)
    figures = torch.stack([losses.detach(), chosen_rewards, rejected_rewards, chosen_logps, rejected_logps, won,
                           *more.values()], 1)
    return losses, figures, sft_logps, router_loss


def parse_args():
    return cli.parse_args(cli.recipe_flags("dpo", __doc__))


def main():
    # The run's settings, settled once (read-only from here); a launch that cannot work is refused here, in one
    # line, before the model loads. Settled as LoRA (adapters on a frozen base), or QLoRA with --bits.
    args = parse_args()
    run, launch = settle.settle_launch(args, recipe="qlora" if args.bits else "lora")
    accelerator = runtime.make_accelerator(run, launch)
    resume = checkpoint.resume_point(accelerator, run, launch)  # the checkpoint to continue, checked before loading
    set_seed(run.seed)

    # Pairs, before the model: each side rendered and tokenised as the SFT recipes tokenise a row, its
    # reply (through its stop signal) the only target. Pairs that cannot train are counted and dropped.
    modeling.ensure_default_model(run.model, accelerator)
    tokenizer = modeling.load_tokenizer(run.model, run.trust_remote_code, run.chat_template)
    processor = processors.load(run.model, tokenizer, run.trust_remote_code)  # None: the model reads text only
    train_set, eval_set, data_format = preferences.prepare_pairs(accelerator, tokenizer, run, launch, processor)

    # Model: the frozen base in 16 bits where mixed precision allows (4-bit with --bits), trainable adapters on top.
    quantization = modeling.quantization_config(launch, run.bits) if run.bits else None
    model = modeling.load_model(run.model, accelerator, launch, frozen=True, quantization=quantization,
                                attention=run.attention, liger=run.liger, trust_remote_code=run.trust_remote_code)
    # A mixture of experts whose config asks for it (output_router_logits) also trains its router to spread
    # the tokens over the experts: transformers' load-balancing loss with this weight (0 for other models).
    router_weight = modeling.router_loss_weight(model)
    if quantization and not launch.shards_parameters:
        # Upcasts norms for stability; FSDP / ZeRO-3 need one dtype throughout, so they skip it.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if run.gradient_checkpointing:  # recompute every Nth layer's activations in the backward instead of keeping them
        modeling.checkpoint_activations(model, every_n_layers=run.gradient_checkpointing)
    lora_config = LoraConfig(
        r=run.lora_r,
        lora_alpha=run.lora_alpha,
        lora_dropout=run.lora_dropout,
        target_modules=modeling.lora_targets(model, cli.lora_targets(run.lora_targets)),  # a VLM: its language model's
        use_dora=run.use_dora,
        use_rslora=run.use_rslora,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora_config)
    modeling.seed_adapter(model, run.seed)  # the same first adapter whatever the strategy split
    modeling.keep_adapter_inputs_in_compute_dtype(model, launch)  # no float32 copy of each adapter's input
    accelerator.print(f"reference: none, {run.loss} scores the policy alone" if run.loss in cli.REFERENCE_FREE_LOSSES
                      else "reference: the base, i.e. this model with its adapters switched off (no second copy)")

    # Batches: shuffled micro-batches of pairs, each one batch of rows (chosen sides, then rejected sides).
    collate = batches.PadPairs(tokenizer.pad_token_id, whole_chosen=run.loss == "orpo",  # (ORPO: the SFT term's rows)
                               pad_rows=images.PadImageRows(processor) if processor else None)  # image pairs: pixels
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
    # The log-probabilities' way to the logits: the LM head run a chunk of positions at a time over the last
    # hidden states, never the whole batch's logits at once (loss_head.py; run.json's loss_path).
    head = loss_head.settle(accelerator, model)

    log = RunLog(accelerator, run, recipe="dpo", launch=launch)
    start_step = checkpoint.resume_from(accelerator, resume, model, optimizer, None)
    # after the resume: a failed load changes nothing
    log.write_run_json(model, None, data_format, optimizer, total_steps, head.description)

    def evaluate_now(step):  # the held-out figures (and --eval-tasks' scores) of the model as it is now
        log.log_eval(step, evaluate_pairs(accelerator, model, eval_loader,
                                          lambda batch: score_pairs(accelerator, model, batch, run, head)[1]))
        if run.eval_tasks:  # lm-eval's tasks on the model as the launch holds it, each rank its share
            log.log_benchmarks(step, benchmarks.score_run(accelerator, launch, run, model, tokenizer, data_format))

    # The loop: one iteration = one optimizer step over grad_accum micro-batches on every rank.
    model.train()
    sync = runtime.StepSync(accelerator)  # the step's one all-reduce; SIGTERM / Ctrl-C stop at the end of a step
    log.start(start_step, total_steps)
    if run.eval_on_start and start_step == 0:  # a baseline, logged as step 0: what the steps then change
        with runtime.same_random_state():  # (it draws nothing the steps would: the same curve without it)
            evaluate_now(0)
    steps = batches.optimizer_steps(train_loader, run.grad_accum, start_step)
    epoch, micro_batches = next(steps)
    step_tokens = sync.count_tokens(micro_batches)  # the target tokens of both sides (ORPO: its SFT targets)
    # A step's loss is the mean over the pairs of the global batch: every micro-batch holds --batch-size
    # pairs, on every rank (a tensor- or sequence-parallel group's ranks each count the group's pairs); ORPO
    # adds its SFT term, the chosen rows' negative log-likelihood: a mean over the step's chosen tokens.
    step_pairs = run.batch_size * run.grad_accum * accelerator.num_processes
    names = ["rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "rewards/accuracies",
             *(["log_odds_ratio", "log_odds_chosen"] if run.loss == "orpo" else [])]
    for step in range(start_step + 1, total_steps + 1):
        step_loss, step_figures, step_nll, step_router_loss = 0.0, 0.0, 0.0, 0.0
        for batch in micro_batches:
            with accelerator.accumulate(model):
                losses, figures, sft_logps, router_loss = score_pairs(accelerator, model, batch, run, head)
                share = losses.sum() / step_pairs  # this micro-batch's share of the step's loss
                if sft_logps is not None:  # ORPO's SFT term (step_tokens: the step's chosen tokens, all ranks')
                    nll = -sft_logps / step_tokens
                    share = share + nll
                    step_nll += nll.detach()
                step_loss += share.detach()
                step_figures += figures[:, 1:].sum(0)  # summed over pairs: rewards, log-probabilities, wins
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
        loss, next_tokens, stopping, (*pair_sums, nll_sum, router_sum) = sync.end_of_step(
            step_loss, next_batches, [*step_figures, step_nll, step_router_loss])
        means = {name: value / step_pairs for name, value in zip(names, pair_sums)}  # over the global batch's pairs
        router_mean = router_sum / (run.grad_accum * accelerator.num_processes) if router_weight else None
        if step == start_step + 1:  # a gather (every rank takes part): what each rank holds, into run.json
            log.record_ranks()
        log.log_step(step, epoch, loss, scheduler.get_last_lr()[0], grad_norm, int(step_tokens), router_mean, figures={
            **means, "rewards/margins": means["rewards/chosen"] - means["rewards/rejected"],
            **({"nll_loss": nll_sum} if run.loss == "orpo" else {})})
        if not math.isfinite(loss):  # stop before saving anything from a diverged model
            preflight.refuse(f"the loss became {loss} at step {step}; lower --lr or --beta, or check the data, and "
                             "start in a new --output-dir (a checkpoint here may already hold the update that diverged)")
        if step == total_steps or (run.eval_every and step % run.eval_every == 0):
            evaluate_now(step)
        if stopping or (run.save_every and step % run.save_every == 0):
            checkpoint.save_checkpoint(accelerator, run, launch, step, None)
        if stopping:
            log.close(f"stopped by {sync.signal_name} after step {step}; continue with --resume auto")
            return
        epoch, micro_batches, step_tokens = next_epoch, next_batches, next_tokens

    # Export: what the trained model computes, then the files that reproduce it.
    checkpoint.save_probe(accelerator, model, None, probe, run.output_dir)
    samples = report.sample_generations(accelerator, launch, model, None, tokenizer,
                                        preferences.chosen_rows(eval_set), run.output_dir, processor=processor)
    adapter_dir = f"{run.output_dir}/adapter"
    checkpoint.save_adapter(accelerator, model, None, processor or tokenizer, adapter_dir)
    if run.merge:
        checkpoint.merge_adapter(accelerator, run.model, adapter_dir, f"{run.output_dir}/merged",
                                 base_4bit=run.bits == 4, dtype=run.save_dtype)
    report.write_model_card(accelerator, run, "dpo", "adapter", samples)
    log.close(f"done: {total_steps} steps; adapter saved to {adapter_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
    runtime.exit_after_a_finished_run()  # a native thread can abort the interpreter's teardown (runtime.py)
