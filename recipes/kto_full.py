"""KTO: preference tuning on replies judged one at a time (thumbs up / thumbs down), of every weight of a causal
language model, under any accelerate strategy.

Launch (pick any file in accelerate_configs/, or your own `accelerate config` file):

    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/kto_full.py \\
        --model my-sft-model --dataset feedback.jsonl --output-dir outputs/kto-full

Each row of --dataset is a judged reply: a `prompt`, a `completion` and a `label` (true: a reply to learn from,
false: one to avoid), as text or chat messages; preference pairs are read as two judged replies (docs/data.md,
"Judged replies"). The reference model is the model as loaded: before the first update it scores every row and its
mismatched row once, and the scores are kept with the tokenised rows in the data cache, so a rerun or a resume
reads them; no second copy of the model. With no --model / --dataset it trains the bundled tiny model on the bundled
pairs, also on a machine without GPUs (add `--num_processes 2 --mixed_precision no` to the launcher).

Writes to --output-dir: run.json (what ran), metrics.jsonl (one line per step and per evaluation, with TRL's
names: loss, kl, rewards/chosen, rewards/rejected, rewards/margins, logps/chosen, logps/rejected),
checkpoints/step-N/ (resumable) and model/ (AutoModelForCausalLM.from_pretrained).

Flags: --model --dataset --eval-dataset --columns --chat-template --output-dir --epochs --max-steps --batch-size
       --global-batch-size --grad-accum --lr --warmup-ratio --weight-decay --max-grad-norm --max-length --seed
       --eval-every --save-every --save-total-limit --resume --gradient-checkpointing --log-every --report-to
       --save-dtype --trust-remote-code --eval-on-start --no-eval-on-start
       --config (a YAML file of any of these flags)
Speed: --compile --no-compile --liger --attention --dataloader-workers
Benchmarks: --eval-tasks --eval-limit --eval-raw-prompts (lm-evaluation-harness tasks, scored where the eval runs)
KTO:   --beta --desirable-weight --undesirable-weight
Refused here (not for judged replies yet): --packing --pipeline-stages --pipeline-schedule --pipeline-chunks,
       sequence parallel
"""

import math

import common.quiet  # noqa: F401  (first: silences library notices nobody can act on)
from common.launching import args as cli, quick_checks

if __name__ == "__main__":  # --help, and a refusal that needs no library, now: the libraries below take seconds to load
    quick_checks.refuse_before_loading("kto_full", __doc__)

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from transformers import get_cosine_schedule_with_warmup

from common.data import batches, preferences
from common.data.formats import IGNORE
from common.launching import deepspeed_config, preflight, settle
from common.model import loss_head, modeling
from common.outputs import checkpoint, report
from common.outputs.runlog import RunLog
from common.training import benchmarks, reference, runtime
from common.training.evaluation import evaluate_feedback


def sequence_logps(accelerator, model, batch, head):
    """Each row's log-probability of its target tokens (their sum: the probability of the whole reply), and a
    mixture of experts' router loss (None for other models). `head`: the run's way to the logits (loss_head.py),
    only where some row has a target and a chunk of positions at a time."""
    positions = batch["target_positions"]
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                    position_ids=batch.get("position_ids"), use_cache=False, **head.forward_arguments(positions))
    token_logps = head.apply(target_logps, outputs, batch["labels"][:, 1:], positions)  # position t predicts t + 1
    return runtime.whole_row_sums(accelerator, model, token_logps.sum(1)), outputs.get("aux_loss")


def target_logps(logits, targets):
    """Each position's log-probability of its target token (0 on prompt and padding), laid out like `targets`."""
    return -F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE,
                            reduction="none").view_as(targets)


def kto_losses(logps, reference_logps, desirable, kl, run):
    """Each row's loss, and its reward (beta x its log-ratio: what the logs call rewards/chosen for the desirable
    rows, rewards/rejected for the others). Every path that trains or evaluates computes its rows' loss here: edit
    it here.

    KTO: the reward is measured from a reference point, `kl`: the policy's mean log-ratio to the reference on
    mismatched rows (prompts answered with other rows' replies), at least 0, no gradient through it. A desirable
    reply's loss is 1 - sigmoid(beta x (its log-ratio - kl)), an undesirable one's 1 - sigmoid(beta x (kl - its
    log-ratio)), weighted by --desirable-weight and --undesirable-weight."""
    ratios = logps - reference_logps
    losses = torch.where(desirable, run.desirable_weight * (1 - torch.sigmoid(run.beta * (ratios - kl))),
                         run.undesirable_weight * (1 - torch.sigmoid(run.beta * (kl - ratios))))
    return losses, run.beta * ratios.detach()


def reference_scores(accelerator, model, batch, head, kept_scores):
    """Without gradients: the reference's log-probabilities of the micro-batch's rows, and (policy, reference)
    log-probabilities of their mismatched rows. The reference: the model as loaded, which scored every row and
    its mismatched row before training (`kept_scores`)."""
    rows = len(batch["desirable"])
    kept = reference.of_batch(kept_scores, batch)  # the rows', then their mismatched rows'
    with torch.no_grad():
        mismatched = sequence_logps(accelerator, model, batches.rows_of(batch, slice(rows, None)), head)[0]
    return kept[:rows], mismatched, kept[rows:]


def row_scores(accelerator, model, batch, head, kept_scores):
    """Per row, for evaluation: [its reply's log-probability, the reference's, its mismatched row's, the
    reference's of that, 1 where it is desirable]."""
    reference_logps, mismatched, mismatched_reference = reference_scores(accelerator, model, batch, head, kept_scores)
    rows = len(batch["desirable"])
    with torch.no_grad():
        logps = sequence_logps(accelerator, model, batches.rows_of(batch, slice(0, rows)), head)[0]
    return torch.stack([logps, reference_logps, mismatched, mismatched_reference, batch["desirable"].to(logps.dtype)], 1)


def parse_args():
    return cli.parse_args(cli.recipe_flags("kto_full", __doc__))


def main():
    # The run's settings, settled once (read-only from here); a launch that cannot work is refused here, in one
    # line, before the model loads. Settled as full fine-tuning: every weight trains.
    run, launch = settle.settle_launch(parse_args(), recipe="full")
    accelerator = runtime.make_accelerator(run, launch)
    resume = checkpoint.resume_point(accelerator, run, launch)  # the checkpoint to continue, checked before loading
    set_seed(run.seed)

    # Judged replies, before the model: each tokenised as the SFT recipes tokenise a row, its reply (through its
    # stop signal) the only target, with its label and its mismatched row. Rows that cannot train are counted
    # and dropped.
    modeling.ensure_default_model(run.model, accelerator)
    tokenizer = modeling.load_tokenizer(run.model, run.trust_remote_code, run.chat_template)
    train_set, eval_set, data_format = preferences.prepare_feedback(accelerator, tokenizer, run, launch)

    # Model: every weight trained, in float32 (mixed precision computes in 16 bits).
    model = modeling.load_model(run.model, accelerator, launch, frozen=False, attention=run.attention,
                                liger=run.liger, trust_remote_code=run.trust_remote_code)
    # A mixture of experts whose config asks for it (output_router_logits) also trains its router to spread
    # the tokens over the experts: transformers' load-balancing loss with this weight (0 for other models).
    router_weight = modeling.router_loss_weight(model)
    if run.gradient_checkpointing:  # recompute every Nth layer's activations in the backward instead of keeping them
        modeling.checkpoint_activations(model, every_n_layers=run.gradient_checkpointing)

    # Batches: shuffled micro-batches of judged replies, each one batch of rows (the replies, then their
    # mismatched rows).
    collate = batches.PadFeedback(tokenizer.pad_token_id)
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
    # The reference: the model as loaded scores every row and its mismatched row once (or a rerun reads the scores)
    key = reference.reference_key(run.model, launch.precision, run.max_length)
    scores = lambda model, batch: sequence_logps(accelerator, model, batch, head)  # noqa: E731  (the recipe's own)
    train_reference, eval_reference = (reference.reference_logps(accelerator, model, rows, collate, run.batch_size,
                                                                 scores, key, "rows") for rows in (train_set, eval_set))

    log = RunLog(accelerator, run, recipe="kto_full", launch=launch)
    start_step = checkpoint.resume_from(accelerator, resume, model, optimizer, None)
    # after the resume: a failed load changes nothing
    log.write_run_json(model, None, data_format, optimizer, total_steps, head.description)

    def evaluate_now(step):  # the held-out figures (and --eval-tasks' scores) of the model as it is now
        log.log_eval(step, evaluate_feedback(accelerator, model, eval_loader,
                                             lambda batch: row_scores(accelerator, model, batch, head, eval_reference),
                                             lambda *scores: kto_losses(*scores, run)))
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
    step_tokens = sync.count_tokens(micro_batches)  # the target tokens of the rows and their mismatched rows
    # A step's loss is the mean over the rows of the global batch: every micro-batch holds --batch-size rows, on
    # every rank (a tensor-parallel group's ranks each count the group's rows).
    step_rows = run.batch_size * run.grad_accum * accelerator.num_processes
    for step in range(start_step + 1, total_steps + 1):
        # KTO's reference point: the policy's mean log-ratio to the reference over the step's mismatched rows,
        # every rank's, taken before the step's first backward, so that it does not depend on how the step is
        # split into micro-batches and processes.
        scored = [reference_scores(accelerator, model, batch, head, train_reference) for batch in micro_batches]
        mismatched_sum = sum((policy - reference).sum() for _, policy, reference in scored)
        mean_ratio = accelerator.reduce(mismatched_sum.double(), "sum") / step_rows
        kl = mean_ratio.clamp(min=0).float()  # (TRL's: the estimate is noisy and often below 0 at the start)
        step_loss, step_figures, step_router_loss = 0.0, 0.0, 0.0
        for batch, (reference_logps, _, _) in zip(micro_batches, scored):
            with accelerator.accumulate(model):
                rows = batches.rows_of(batch, slice(0, len(batch["desirable"])))
                logps, router_loss = sequence_logps(accelerator, model, rows, head)
                desirable = batch["desirable"]
                losses, rewards = kto_losses(logps, reference_logps, desirable, kl, run)
                share = losses.sum() / step_rows  # this micro-batch's share of the step's loss
                step_loss += share.detach()
                # summed over rows: the desirable rows' rewards and log-probabilities, the others', and their counts
                step_figures += torch.stack([
                    *(figure[which].sum() for figure in (rewards, logps.detach()) for which in (desirable, ~desirable)),
                    desirable.sum(), (~desirable).sum()]).double()
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

        # The step's one collective: the loss and the rows' figures summed over all ranks, the stop flag, and the
        # next step's target tokens (its micro-batches are fetched now to travel along).
        next_epoch, next_batches = next(steps) if step < total_steps else (epoch, [])
        loss, next_tokens, stopping, (*sums, router_sum) = sync.end_of_step(
            step_loss, next_batches, [*step_figures, step_router_loss])
        chosen_reward, rejected_reward, chosen_logps, rejected_logps, chosen, rejected = sums
        figures = {"kl": kl.item(), "kl_unclamped": mean_ratio.item()}  # what the clamp to 0 hid, beside it
        if chosen:  # (a step may hold no row of one label: its figures are left out, as TRL leaves them)
            figures.update({"rewards/chosen": chosen_reward / chosen, "logps/chosen": chosen_logps / chosen})
        if rejected:
            figures.update({"rewards/rejected": rejected_reward / rejected, "logps/rejected": rejected_logps / rejected})
        if chosen and rejected:
            figures["rewards/margins"] = figures["rewards/chosen"] - figures["rewards/rejected"]
        router_mean = router_sum / (run.grad_accum * accelerator.num_processes) if router_weight else None
        if step == start_step + 1:  # a gather (every rank takes part): what each rank holds, into run.json
            log.record_ranks()
        log.log_step(step, epoch, loss, scheduler.get_last_lr()[0], grad_norm, int(step_tokens), router_mean,
                     figures=figures)
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
                                        preferences.desirable_rows(eval_set), run.output_dir)
    model_dir = f"{run.output_dir}/model"
    checkpoint.save_full_model(accelerator, model, None, tokenizer, model_dir, run.save_dtype)
    report.write_model_card(accelerator, run, "kto_full", "model", samples)
    log.close(f"done: {total_steps} steps; model saved to {model_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
    runtime.exit_after_a_finished_run()  # a native thread can abort the interpreter's teardown (runtime.py)
