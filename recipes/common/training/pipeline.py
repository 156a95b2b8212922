"""Pipeline parallel: the decoder's layers in contiguous stages, one per process, the step's
micro-batches flowing through them under `torch.distributed.pipelining`'s schedules (1F1B by
default, GPipe, interleaved 1F1B with several stages per process), and pipelines replicated over the
remaining processes (pipeline x data parallel).

The model is split by module, not traced (tracing fails on models with rotary embeddings): every
process keeps the Hugging Face model whole in structure, with the layers it does not run replaced
by a pass-through, the embedding only on the first stage and the final norm and LM head only on
the last. Each stage then calls the model's own forward, so its causal and padding masks, packed
rows' `position_ids` and rotary embeddings are computed exactly as in one process, and the layers
it holds keep their names (`model.layers.12...`): saving needs no renaming.

The ranks of one pipeline read the same micro-batches; only the hidden states travel between
stages. The loss is computed on the last stage, summed over target tokens and divided by the
target tokens of the whole global batch, as in every other strategy, and the replicas' gradients
are summed.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Callable

import torch
import torch.distributed as dist

from ..data.batches import IGNORE, target_weights
from ..model.loss_head import LossHead
from ..model.pipeline_layout import PassThrough, PipelineLayout, decoder_of, keep_stage, layout_of
from .evaluation import batch_figures


class StageModule(torch.nn.Module):
    """This process's share of a Hugging Face causal LM: the layers of the parts it runs (the others
    passed through), the embedding on the first stage, the final norm and LM head on the last. The batch
    keys other than the input (the padding mask, packed rows' position ids) are not sent between stages:
    every rank of a pipeline holds the step's micro-batches (`begin_step`), and the schedule says which
    one each part computes (`Part.index`)."""

    def __init__(self, model, layout: PipelineLayout, autocast: Callable = nullcontext):
        super().__init__()
        self.model = model
        self.layout = layout
        # the launch's mixed precision: the schedule calls the parts outside accelerate's forward
        self.autocast = autocast
        self.micro_batches: list[dict] = []
        self.base_and_decoder = keep_stage(model, layout)  # a tuple: not registered twice as submodules
        # the schedule's stages: one per part this process runs (a list: not registered as submodules either)
        self.chunks = [Part(self, part) for part in layout.parts_of()]

    def begin_step(self, micro_batches: list[dict]) -> None:
        self.micro_batches = micro_batches
        for chunk in self.chunks:
            chunk.index = 0


class Part(torch.nn.Module):
    """One part of the layers, run by the schedule as one pipeline stage: the model's own forward with
    only this part's layers (and the final norm on the last part, whose output the loss takes to the head a
    chunk of positions at a time)."""

    def __init__(self, stage: StageModule, part: int):
        super().__init__()
        layout = stage.layout
        self.owner = (stage,)  # a tuple: the stage module holds the weights
        self.is_first, self.is_last = part == 0, part == layout.parts - 1
        _, decoder = stage.base_and_decoder
        kept = layout.layer_range(part)
        self.layers = torch.nn.ModuleList(layer if index in kept else PassThrough()
                                          for index, layer in enumerate(decoder.layers))
        self.norm = decoder.norm if self.is_last else torch.nn.Identity()  # the final norm on the last part only
        self.index = 0  # the micro-batch being computed, set by `Stage.forward_one_chunk`

    def forward(self, inputs):
        stage = self.owner[0]
        batch = stage.micro_batches[self.index]  # (the stage's first, shape-finding forward: micro-batch 0)
        extra = {key: batch[key].to(inputs.device) for key in ("attention_mask", "position_ids") if key in batch}
        given = {"input_ids": inputs} if self.is_first else {"inputs_embeds": inputs}
        base, decoder = stage.base_and_decoder
        held = decoder.layers, decoder.norm
        decoder.layers, decoder.norm = self.layers, self.norm  # the decoder runs this part
        try:
            with stage.autocast():
                hidden = decoder(**given, **extra, use_cache=False).last_hidden_state
        finally:
            decoder.layers, decoder.norm = held
        return hidden


def process_groups(layout: PipelineLayout):
    """(this pipeline's group, this stage's group across the replicas). Every rank creates every group,
    in the same order, as torch.distributed requires."""
    pipeline_group = stage_group = None
    for replica in range(layout.replicas):
        ranks = [replica * layout.stages + s for s in range(layout.stages)]
        group = dist.new_group(ranks)
        if layout.replica == replica:
            pipeline_group = group
    for stage in range(layout.stages):
        ranks = [r * layout.stages + stage for r in range(layout.replicas)]
        group = dist.new_group(ranks)
        if layout.stage == stage:
            stage_group = group
    return pipeline_group, stage_group


def _stage_class():
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        """Tells the stage's module which micro-batch the schedule computes next."""

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            self.submod.index = fwd_chunk_id
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    return Stage


def pad_micro_batch(batch: dict, length: int, pad_token_id: int) -> dict:
    """`batch` padded on the right to `length` tokens, as `batches.PadToLongest` pads (the schedules
    split one tensor into equal micro-batches, and a stage's buffers have one shape)."""
    pad = length - batch["input_ids"].shape[1]
    if pad == 0:
        return batch
    rows = batch["input_ids"].shape[0]
    padded = {"input_ids": torch.cat([batch["input_ids"], batch["input_ids"].new_full((rows, pad), pad_token_id)], 1),
              "labels": torch.cat([batch["labels"], batch["labels"].new_full((rows, pad), IGNORE)], 1)}
    if "attention_mask" in batch:
        padded["attention_mask"] = torch.cat([batch["attention_mask"], batch["attention_mask"].new_zeros((rows, pad))], 1)
    if "position_ids" in batch:  # packed rows: the padding is a row of its own
        tail = torch.arange(pad, dtype=batch["position_ids"].dtype).expand(rows, pad)
        padded["position_ids"] = torch.cat([batch["position_ids"], tail], 1)
    if "loss_weights" in batch:  # laid out like the labels; the padding has no target
        padded["loss_weights"] = torch.cat([batch["loss_weights"], batch["loss_weights"].new_zeros((rows, pad))], 1)
    return padded


# A step's micro-batches are padded to a multiple of this many tokens, so that few shapes (each with its
# own stage buffers) occur.
LENGTH_MULTIPLE = 64


class Pipeline:
    """Runs one optimizer step's micro-batches through the stages (`train_step`), averages nothing
    itself: the loss of each micro-batch is its summed token loss / the global batch's target tokens."""

    def __init__(self, model, layout: PipelineLayout, device, schedule: str, micro_batches: int, pad_token_id: int,
                 autocast: Callable = nullcontext):
        self.layout = layout
        self.device = torch.device(device)
        self.module = StageModule(model, layout, autocast).to(self.device)
        self.pipeline_group, self.stage_group = process_groups(layout)
        self.schedule_name, self.micro_batches, self.pad_token_id = schedule, micro_batches, pad_token_id
        self.schedules: dict[tuple[int, int], object] = {}  # (rows, tokens) of a micro-batch -> its schedule
        self.step_tokens = 1
        self.loss_sums: dict[int, torch.Tensor] = {}
        base = self.module.base_and_decoder[0]
        # the last stage's head, run with the recipe's loss a chunk of positions at a time (model/loss_head.py):
        # the split already refused a model whose logits are more than the head's output
        self.head = LossHead(base.lm_head, None, autocast) if self.layout.is_last else None

    @property
    def bubble(self) -> float:
        """The share of a step each stage waits: (p - 1) / (m + p - 1) under 1F1B and GPipe; the
        interleaved schedule's v parts per process cut it to (p - 1) / (v m + p - 1)."""
        p, m, v = self.layout.stages, self.micro_batches, self.layout.chunks
        return (p - 1) / (v * m + p - 1)

    def layers_by_part(self) -> list[list[int]]:
        return [[r.start, r.stop - 1] for r in map(self.layout.layer_range, range(self.layout.parts))]

    def describe(self) -> str:
        layout = self.layout
        layers = ", ".join(f"{first}-{last}" for first, last in self.layers_by_part())
        parts = (f"{layout.chunks} parts of the layers per process (process s runs parts s, s + {layout.stages}, "
                 "...); layers by part" if layout.chunks > 1 else "layers by stage")
        line = (f"{layout.stages} stages x {layout.replicas} replica(s), {self.schedule_name}, {self.micro_batches} "
                f"micro-batches per step; {parts}: {layers}; each stage idles {self.bubble:.0%} of a step")
        if self.micro_batches < layout.stages:
            line += f" (fewer micro-batches than stages: --grad-accum {2 * layout.stages} would idle " \
                    f"{(layout.stages - 1) / (3 * layout.stages - 1):.0%})"
        return line

    def record(self) -> dict:
        """run.json's `pipeline`: the layout, the schedule, which layers each stage (part) holds."""
        return {"stages": self.layout.stages, "replicas": self.layout.replicas, "schedule": self.schedule_name,
                "chunks": self.layout.chunks, "micro_batches": self.micro_batches, "bubble": round(self.bubble, 4),
                "layers_by_stage": self.layers_by_part(),
                "rank_layout": "rank = replica * stages + stage" + (
                    "; stage s runs parts s, s + stages, ..." if self.layout.chunks > 1 else "")}

    def shard(self, accelerator, loader, every_pipeline: bool = False):
        """`loader`'s batches for this pipeline: split over the replicas (the ranks of a pipeline read the
        same ones), or all of them for every pipeline (`every_pipeline`: evaluation)."""
        from accelerate.data_loader import prepare_data_loader

        replicas, replica = (1, 0) if every_pipeline else (self.layout.replicas, self.layout.replica)
        return prepare_data_loader(loader, device=accelerator.device, num_processes=replicas, process_index=replica,
                                   put_on_device=True, use_seedable_sampler=True,
                                   non_blocking=accelerator.device.type == "cuda")

    def counts_tokens(self) -> bool:
        """Only the last stages count target tokens (every stage of a pipeline holds the same batches)."""
        return self.layout.is_last

    def schedule_for(self, shape: tuple[int, int]):
        """The stage and schedule for micro-batches of this shape (built once per shape)."""
        if shape not in self.schedules:
            from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

            stage_class = _stage_class()
            stages = [stage_class(chunk, part, self.layout.parts, self.device, group=self.pipeline_group)
                      for chunk, part in zip(self.module.chunks, self.layout.parts_of())]
            if self.schedule_name == "interleaved":
                schedule = ScheduleInterleaved1F1B(stages, n_microbatches=self.micro_batches, loss_fn=self.loss,
                                                   scale_grads=False)
            else:
                kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[self.schedule_name]
                schedule = kind(stages[0], n_microbatches=self.micro_batches, loss_fn=self.loss, scale_grads=False)
            self.schedules[shape] = schedule
        return self.schedules[shape]

    def loss(self, hidden, labels):
        """The micro-batch's summed token loss (the recipe's `token_losses`, over the last stage's hidden states a
        chunk of positions at a time) over the global batch's target tokens. The schedule hands over the labels
        only: the targets' weights, where the collator gives some, come from the micro-batch being computed."""
        targets = labels[:, 1:]
        index = self.module.chunks[-1].index
        weights = target_weights(self.module.micro_batches[index].get("loss_weights"))
        every_position = torch.arange(targets.shape[1], device=hidden.device)
        token_loss = self.head.per_chunk(self.token_losses, hidden, targets, every_position, weights).sum()
        # by micro-batch: the stage's first, shape-finding forward (micro-batch 0 again) is overwritten
        self.loss_sums[index] = token_loss.detach()
        return token_loss / self.step_tokens

    def train_step(self, micro_batches: list[dict], step_tokens: int, token_losses) -> torch.Tensor:
        """Forward and backward of the step's micro-batches, each micro-batch's loss the sum of the recipe's
        `token_losses` (logits, next tokens -> a loss per token); the summed loss (0 but on the last stage)."""
        longest = max(b["input_ids"].shape[1] for b in micro_batches)
        length = -(-longest // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
        micro_batches = [pad_micro_batch(b, length, self.pad_token_id) for b in micro_batches]
        self.module.begin_step(micro_batches)
        self.step_tokens, self.token_losses = step_tokens, token_losses  # what `loss`, the schedule's loss_fn, reads
        self.loss_sums = {}
        schedule = self.schedule_for(tuple(micro_batches[0]["input_ids"].shape))
        inputs = torch.cat([b["input_ids"] for b in micro_batches]).to(self.device)
        labels = torch.cat([b["labels"] for b in micro_batches]).to(self.device)
        if self.layout.is_first and self.layout.is_last:
            schedule.step(inputs, target=labels)
        elif self.layout.is_first:
            schedule.step(inputs)
        elif self.layout.is_last:
            schedule.step(target=labels)
        else:
            schedule.step()
        self.sum_replica_gradients([p for p in self.module.parameters() if p.requires_grad])
        return torch.stack(list(self.loss_sums.values())).sum() if self.loss_sums else torch.zeros((), device=self.device)

    def sum_replica_gradients(self, parameters) -> None:
        """The replicas' gradients of each stage summed (each is already over the global batch's tokens)."""
        grads = [p.grad for p in parameters if p.grad is not None]
        if self.layout.replicas == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.stage_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def clip_grad_norm(self, parameters, max_norm: float) -> torch.Tensor:
        """The norm of the whole model's gradient (every stage's part), and clip by it."""
        grads = [p.grad for p in parameters if p.grad is not None]
        local = sum((g.detach().float().pow(2).sum() for g in grads), torch.zeros((), device=self.device))
        dist.all_reduce(local, group=self.pipeline_group)
        total = local.sqrt()
        if max_norm and math.isfinite(max_norm):
            scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(scale.to(g.dtype))
        return total

    # ------------------------------------------------------------------ forward only (evaluation, probe)

    def forward_only(self, batch: dict):
        """The logits of `batch` on the last stage (None on the others): each part's output sent to the
        process of the next part, its dtype and shape first."""
        self.module.begin_step([batch])
        layout = self.layout
        with torch.no_grad():
            for chunk, part in zip(self.module.chunks, layout.parts_of()):
                if chunk.is_first:
                    inputs = batch["input_ids"].to(self.device)
                else:
                    header = torch.zeros(4, dtype=torch.int64, device=self.device)  # dtype, then the 3-D shape
                    dist.recv(header, src=layout.rank_of(part - 1))
                    dtype = DTYPES[int(header[0])]
                    inputs = torch.empty([int(n) for n in header[1:4]], dtype=dtype, device=self.device)
                    dist.recv(inputs, src=layout.rank_of(part - 1))
                output = chunk(inputs)
                if chunk.is_last:
                    return self.head.chunk_logits(output)
                header = torch.tensor([DTYPES.index(output.dtype), *output.shape], dtype=torch.int64,
                                      device=self.device)
                dist.send(header, dst=layout.rank_of(part + 1))
                dist.send(output.contiguous(), dst=layout.rank_of(part + 1))
        return None

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, stop_ids: list) -> torch.Tensor:
        """Greedy decoding of `prompt` (1 x length) through the stages, the sequence on every rank of this
        pipeline: the last stage picks each token and tells the others. No KV cache: each token runs the
        whole sequence again (a few samples of a few dozen tokens)."""
        ids = prompt.to(self.device)
        last = self.layout.rank_of(self.layout.parts - 1)
        for _ in range(max_new_tokens):
            logits = self.forward_only({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
            token = logits[:, -1].argmax(-1) if logits is not None else ids.new_zeros(1)
            dist.broadcast(token, src=last, group=self.pipeline_group)
            ids = torch.cat([ids, token[:, None]], 1)
            if int(token) in stop_ids:
                break
        return ids

    def evaluate(self, eval_loader, token_losses) -> dict:
        """`evaluation.evaluate`'s figures: every pipeline runs every batch, the first pipeline's last stage
        counts them, and one all-reduce tells every rank."""
        self.module.eval()
        totals = torch.zeros(4, dtype=torch.float64, device=self.device)
        for batch in eval_loader:
            logits = self.forward_only(batch)
            if logits is not None and self.layout.replica == 0:
                weights = target_weights(batch.get("loss_weights"))
                totals += batch_figures(logits.float(), batch["labels"][:, 1:].to(self.device), token_losses,
                                        None if weights is None else weights.to(self.device))
        self.module.train()
        dist.all_reduce(totals)
        loss_sum, tokens, exact, rows = totals.tolist()
        return {"eval_loss": loss_sum / max(tokens, 1), "eval_exact_match": exact / max(rows, 1)}

    # ------------------------------------------------------------------ export

    def gathered_state_dict(self, model) -> dict | None:
        """The whole model's state dict on rank 0 (None elsewhere), gathered from the first pipeline's
        stages, whose keys are the model's own (a stage keeps its layers' names). Of a peft model: the
        adapter's tensors as peft saves them (peft picks them by the modules of the model it is given,
        so each stage picks its own)."""
        if is_peft(model):
            from peft import get_peft_model_state_dict

            mine = get_peft_model_state_dict(model)
        else:
            mine = model.state_dict()
        mine = {key: value.detach().cpu() for key, value in mine.items()}
        if self.layout.replica != 0:
            return None
        parts = [None] * self.layout.stages if self.layout.rank == 0 else None
        dist.gather_object(mine, parts, dst=0, group=self.pipeline_group)
        if self.layout.rank != 0:
            return None
        whole = {}
        for part in parts:
            whole.update(part)
        return whole


def is_peft(model) -> bool:
    return hasattr(model, "peft_config")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def split(accelerator, launch, run, model, pad_token_id: int) -> Pipeline | None:
    """Under --pipeline-stages N > 1: keep this process's stage of `model`, build its schedule, and say
    the layout in one line; None for every other launch. The recipe hands it to what runs, evaluates,
    checkpoints and exports the model (their `stages`)."""
    if launch.pipeline_stages == 1:
        return None
    _, decoder = decoder_of(model)
    layout = layout_of(accelerator, launch, len(decoder.layers))
    pipe = Pipeline(model, layout, accelerator.device, run.pipeline_schedule, run.grad_accum, pad_token_id,
                    accelerator.autocast)
    if accelerator.is_main_process:
        print(f"pipeline: {pipe.describe()}", flush=True)
    return pipe
