"""LoRA fine-tuning of a causal language model under any accelerate strategy.

Launch (pick any file in accelerate_configs/, or your own `accelerate config` file):

    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/lora.py \\
        --model TinyLlama/TinyLlama-1.1B-Chat-v1.0 --dataset my_data.jsonl --output-dir outputs/lora

With no --model / --dataset it trains the bundled tiny model on the bundled data, also on a
machine without GPUs (add `--num_processes 2 --mixed_precision no` to the launcher). A vision-language
model (Qwen2-VL, LLaVA, ...) trains on chat rows with images the same way (docs/data.md#images).

Writes to --output-dir: run.json (what ran), metrics.jsonl (one line per step and per
evaluation), checkpoints/step-N/ (resumable), adapter/ (PeftModel.from_pretrained) and, with
--merge, merged/ (AutoModelForCausalLM.from_pretrained).

Flags: --model --dataset --eval-dataset --columns --chat-template --packing --output-dir --epochs --max-steps --batch-size --global-batch-size
       --grad-accum --lr --warmup-ratio --weight-decay --max-grad-norm --max-length --seed --eval-every
       --save-every --save-total-limit --resume --gradient-checkpointing --log-every --report-to --save-dtype
       --trust-remote-code --eval-on-start --no-eval-on-start
       --config (a YAML file of any of these flags)
Pipeline parallel: --pipeline-stages --pipeline-schedule --pipeline-chunks
Speed: --compile --no-compile --liger --attention --dataloader-workers
Benchmarks: --eval-tasks --eval-limit --eval-raw-prompts (lm-evaluation-harness tasks, scored where the eval runs)
LoRA:  --lora-r --lora-alpha --lora-dropout --lora-targets --use-dora --use-rslora --merge
Images: --train-vision-tower --train-projector (a vision-language model's parts trained too; default: frozen)
"""

import math

import common.quiet  # noqa: F401  (first: silences library notices nobody can act on)
from common.launching import args as cli, quick_checks

if __name__ == "__main__":  # --help, and a refusal that needs no library, now: the libraries below take seconds to load
    quick_checks.refuse_before_loading("lora", __doc__)

import torch
from accelerate.utils import set_seed
from peft import LoraConfig, get_peft_model
from transformers import get_cosine_schedule_with_warmup

from common.data import batches, images, preparation
from common.launching import batch_size, deepspeed_config, preflight, settle
from common.model import loss_head, modeling, processors, vision
from common.outputs import checkpoint, report
from common.outputs.runlog import RunLog
from common.training import benchmarks, pipeline, runtime
from common.training.evaluation import evaluate


def token_losses(logits, targets, weights=None):
    """The loss of each target token, laid out like `targets`: the cross-entropy of the next token, times
    its weight where the batch has weights. Prompt and padding targets are IGNORE and count 0. Every path
    that trains or evaluates computes its loss here (the loop below, pipeline parallel's schedule,
    evaluation's eval_loss), a chunk of positions or a slice of each row at a time: a weight that needs
    the whole row comes from the collator (`weights=` below; docs/architecture.md)."""
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                               ignore_index=batches.IGNORE, reduction="none").view_as(targets)
    return losses if weights is None else losses * weights


def parse_args():
    return cli.parse_args(cli.recipe_flags("lora", __doc__))


def main():
    # The run's settings, settled once: the flags, the --config file, what the accelerate / DeepSpeed file fixes and
    # the batch-size rules (read-only from here; run.json lists what a file or rule changed). A launch that cannot
    # work is refused here, in one line, before the model loads.
    run, launch = settle.settle_launch(parse_args(), recipe="lora")
    accelerator = runtime.make_accelerator(run, launch)
    resume = checkpoint.resume_point(accelerator, run, launch)  # the checkpoint to continue, checked before loading
    set_seed(run.seed)

    # Data, before the model: a file that cannot be read stops the run here (file:line), rows that
    # cannot train are counted and dropped. Prompt tokens are masked: the loss covers the responses only.
    modeling.ensure_default_model(run.model, accelerator)
    tokenizer = modeling.load_tokenizer(run.model, run.trust_remote_code, run.chat_template)
    processor = processors.load(run.model, tokenizer, run.trust_remote_code)  # None: the model reads text only
    train_set, eval_set, data_format = preparation.prepare(accelerator, tokenizer, run, launch, processor)

    # Model: the frozen base in 16 bits where mixed precision allows, trainable adapters on top.
    model = modeling.load_model(run.model, accelerator, launch, frozen=True, attention=run.attention,
                                liger=run.liger, trust_remote_code=run.trust_remote_code)
    # A mixture of experts whose config asks for it (output_router_logits) also trains its router to spread
    # the tokens over the experts: transformers' load-balancing loss with this weight (0 for other models).
    router_weight = modeling.router_loss_weight(model)
    if run.gradient_checkpointing:  # recompute every Nth layer's activations in the backward instead of keeping them
        modeling.checkpoint_activations(model, every_n_layers=run.gradient_checkpointing)
    lora_config = LoraConfig(
        r=run.lora_r,
        lora_alpha=run.lora_alpha,
        lora_dropout=run.lora_dropout,
        # a vision-language model: its language model's layers, and its vision tower's with --train-vision-tower
        target_modules=modeling.lora_targets(model, cli.lora_targets(run.lora_targets), run.train_vision_tower),
        # --train-projector: a vision-language model's projector trained whole, saved with the adapter
        modules_to_save=vision.projector_modules(model) if run.train_projector else None,
        use_dora=run.use_dora,
        use_rslora=run.use_rslora,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora_config)
    modeling.seed_adapter(model, run.seed)  # the same first adapter whatever the strategy split
    modeling.keep_adapter_inputs_in_compute_dtype(model, launch)  # no float32 copy of each adapter's input
    # --batch-size auto: does a real step of the planned micro-batch fit the GPU (its loss: token_losses above)?
    run = batch_size.confirm_on_gpu(accelerator, launch, model, run, token_losses)
    # Pipeline parallel (--pipeline-stages N): this process keeps its stage of the layers, and a schedule runs
    # the step's micro-batches through the stages (None for every other launch).
    stages = pipeline.split(accelerator, launch, run, model, tokenizer.pad_token_id)

    # Batches: shuffled micro-batches, each padded to its longest row; a fixed one to check reloads against.
    # To batch differently, swap the collator: any function from a list of rows to a dict of tensors. To weight
    # tokens by their whole row, add weights=f: f(row) gives a weight per label (docs/architecture.md).
    collate = batches.PadToLongest(tokenizer.pad_token_id)
    if processor:  # images in the rows: the model's processor makes its pixel inputs as it collates (images.py)
        collate = images.PadImageRows(processor)
    train_loader, eval_loader = batches.make_loaders(train_set, eval_set, collate, run.batch_size,
                                                  run.dataloader_workers)
    probe = next(iter(eval_loader))

    # fused: one kernel updates every tensor of a group (a loop over tensors otherwise; docs/speed-options.md).
    # The groups keep tensor parallel's split weights apart from whole ones: one kernel takes one kind.
    optimizer = torch.optim.AdamW(
        modeling.trained_parameter_groups(model), lr=run.lr, weight_decay=run.weight_decay, fused=True
    )
    steps_per_epoch = batches.steps_per_epoch(len(train_loader) // launch.data_parallel_size, run.grad_accum)
    total_steps = run.max_steps or math.ceil(run.epochs * steps_per_epoch)
    # compiled by default only where the planned steps repay compiling (a flag or a config file decides first)
    run = settle.settle_compile_steps(run, total_steps)
    if run.compile:
        modeling.compile_layers(model)  # the first steps are slower while each shape compiles
    # The learning rate: linear warm-up over --warmup-ratio of the steps, then cosine decay to 0; a DeepSpeed
    # config's own `scheduler` section replaces it, run as its file asks (docs/config-files.md).
    if run.deepspeed_scheduler:
        scheduler = deepspeed_config.deepspeed_schedule(optimizer, run.deepspeed_scheduler, run, total_steps)
    else:
        scheduler = get_cosine_schedule_with_warmup(optimizer, int(run.warmup_ratio * total_steps), total_steps)
    if stages:  # no DDP around a stage: the stages pass activations, and each pipeline reads its own batches
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
        train_loader = stages.shard(accelerator, train_loader)
        eval_loader = stages.shard(accelerator, eval_loader, every_pipeline=True)
    else:
        model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
            model, optimizer, train_loader, eval_loader, scheduler
        )
    parameters = list(model.parameters())  # after prepare (FSDP's shards); listed once, not walked each step
    # The loss's way to the logits: the LM head run a chunk of positions at a time over the last hidden
    # states, so the step never holds the whole batch's logits (or, for a model whose logits are more
    # than its head's output, the model's own logits). run.json's loss_path says which.
    head = loss_head.settle(accelerator, model, stages)

    log = RunLog(accelerator, run, recipe="lora", launch=launch)
    start_step = checkpoint.resume_from(accelerator, resume, model, optimizer, stages)
    # after the resume: a failed load changes nothing
    log.write_run_json(model, stages, data_format, optimizer, total_steps, head.description)

    def evaluate_now(step):  # the held-out loss and exact match (and --eval-tasks' scores) of the model as it is now
        log.log_eval(step, evaluate(accelerator, model, eval_loader, token_losses, head, stages))
        if run.eval_tasks:  # lm-eval's tasks on the model as the launch holds it, each rank its share
            log.log_benchmarks(step, benchmarks.score_run(accelerator, launch, run, model, tokenizer, data_format))

    # The loop: one iteration = one optimizer step over grad_accum micro-batches on every rank.
    model.train()
    # The loop's collectives; SIGTERM / Ctrl-C stop it at the end of a step (a pipeline's last stage counts its tokens).
    sync = runtime.StepSync(accelerator, counts_tokens=stages.counts_tokens() if stages else True)
    # Clipping the norm of the whole model's gradient (under a pipeline: every stage's part of it).
    clip_grad_norm = stages.clip_grad_norm if stages else accelerator.clip_grad_norm_
    log.start(start_step, total_steps)
    if run.eval_on_start and start_step == 0:  # a baseline, logged as step 0: what the steps then change
        with runtime.same_random_state():  # (it draws nothing the steps would: the same curve without it)
            evaluate_now(0)
    steps = batches.optimizer_steps(train_loader, run.grad_accum, start_step)
    epoch, micro_batches = next(steps)
    # A step's loss is the mean over every target token of the global batch (all micro-batches, all
    # ranks), so the count comes first.
    step_tokens = sync.count_tokens(micro_batches)
    for step in range(start_step + 1, total_steps + 1):
        step_loss = step_router_loss = 0.0
        if stages:  # pipeline parallel: the schedule runs each micro-batch's forward and backward, stage by stage
            with accelerator.autocast():
                step_loss = stages.train_step(micro_batches, int(step_tokens), token_losses)
        else:
            for batch in micro_batches:
                with accelerator.accumulate(model):
                    labels, positions = batch.pop("labels"), batch.pop("target_positions")
                    targets = labels[:, 1:]  # position t predicts token t + 1
                    weights = batches.target_weights(batch.pop("loss_weights", None))  # the collator's, if any
                    # Logits only where some row has a target, a chunk of positions at a time: the loss of
                    # each chunk is kept, not its logits (loss_head.py). No KV cache in training.
                    outputs = model(**batch, use_cache=False, **head.forward_arguments(positions))
                    token_loss = head.apply(token_losses, outputs, targets, positions, weights)  # defined above
                    router_loss = outputs.get("aux_loss")  # a mixture of experts' (None for other models)
                    del outputs
                    loss_sum = token_loss.sum()
                    step_loss += loss_sum.detach()
                    # The gradient of the global token mean: / step_tokens (every rank's micro-batches), and
                    # undo accelerate's division by grad_accum and the gradient all-reduce's mean over ranks
                    # (tensor parallel: each rank of a group counts the group's tokens; the same factor cancels it).
                    objective = loss_sum / step_tokens * run.grad_accum * accelerator.num_processes
                    if router_weight:  # the router's loss: its mean over micro-batches and ranks, as the backward scales it
                        objective = objective + router_weight * router_loss
                        step_router_loss += router_loss.detach()
                    accelerator.backward(objective)
        grad_norm = clip_grad_norm(parameters, run.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

        # The step's one collective (every rank takes part): the loss summed over all ranks, the stop
        # flag, and the next step's target tokens: its micro-batches are fetched now to travel along.
        next_epoch, next_batches = next(steps) if step < total_steps else (epoch, [])
        summed_loss, next_tokens, stopping, (router_sum,) = sync.end_of_step(step_loss, next_batches,
                                                                               [step_router_loss])
        loss = summed_loss / int(step_tokens)  # the mean over the global batch's target tokens
        if step == start_step + 1:  # a gather (every rank takes part): what each rank holds, into run.json
            log.record_ranks()
        router_mean = router_sum / (run.grad_accum * accelerator.num_processes) if router_weight else None
        log.log_step(step, epoch, loss, scheduler.get_last_lr()[0], grad_norm, int(step_tokens), router_mean)
        if not math.isfinite(loss):  # stop before saving anything from a diverged model
            preflight.refuse(f"the loss became {loss} at step {step}; lower --lr or check the data, and start "
                             "in a new --output-dir (a checkpoint here may already hold the update that diverged)")
        if step == total_steps or (run.eval_every and step % run.eval_every == 0):
            evaluate_now(step)
        if stopping or (run.save_every and step % run.save_every == 0):
            checkpoint.save_checkpoint(accelerator, run, launch, step, stages)
        if stopping:
            log.close(f"stopped by {sync.signal_name} after step {step}; continue with --resume auto")
            return
        epoch, micro_batches, step_tokens = next_epoch, next_batches, next_tokens

    # Export: what the trained model computes, then the files that reproduce it.
    checkpoint.save_probe(accelerator, model, stages, probe, run.output_dir)
    samples = report.sample_generations(accelerator, launch, model, stages, tokenizer, eval_set, run.output_dir,
                                        processor=processor)
    adapter_dir = f"{run.output_dir}/adapter"
    checkpoint.save_adapter(accelerator, model, stages, processor or tokenizer, adapter_dir)
    if run.merge:
        checkpoint.merge_adapter(accelerator, run.model, adapter_dir, f"{run.output_dir}/merged", dtype=run.save_dtype)
    report.write_model_card(accelerator, run, "lora", "adapter", samples)
    log.close(f"done: {total_steps} steps; adapter saved to {adapter_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
    runtime.exit_after_a_finished_run()  # a native thread can abort the interpreter's teardown (runtime.py)
