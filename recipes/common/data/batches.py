"""Tokenised (or packed) rows -> micro-batches, and the stream of optimizer steps the training loop takes."""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader

from ..refusal import refuse
from .formats import IGNORE


class PadToLongest:
    """Pads a micro-batch to its longest row; padding is masked out of attention and loss.

    Packed rows have no attention mask: their padding gets positions of its own (a separate
    "row"), so nothing real attends to it, and its labels are ignored.

    `weights`, a function of a whole row (its `input_ids`, `labels`, and a packed row's `position_ids`) giving
    one weight per label: the batch also carries `loss_weights`, laid out like `labels` (float32, padding 0).
    The loss sees a chunk of positions, or a slice of each row, at a time; these travel with the labels, so
    `token_losses` gets the weights of exactly the targets it scores (docs/architecture.md).
    """

    def __init__(self, pad_token_id: int, weights=None):
        self.pad_token_id = pad_token_id
        self.weights = weights

    def __call__(self, rows: list[dict]) -> dict:
        longest = max(len(row["input_ids"]) for row in rows)
        packed = "position_ids" in rows[0]
        batch = {"input_ids": [], "labels": [], ("position_ids" if packed else "attention_mask"): []}
        if self.weights is not None:
            batch["loss_weights"] = []
        for row in rows:
            length = len(row["input_ids"])
            pad = longest - length
            batch["input_ids"].append(row["input_ids"] + [self.pad_token_id] * pad)
            batch["labels"].append(row["labels"] + [IGNORE] * pad)
            if packed:
                batch["position_ids"].append(row["position_ids"] + list(range(pad)))
            else:
                batch["attention_mask"].append([1] * length + [0] * pad)
            if self.weights is not None:
                batch["loss_weights"].append(self.row_weights(row) + [0.0] * pad)
        return {key: torch.tensor(value, dtype=torch.float32 if key == "loss_weights" else None)
                for key, value in batch.items()}

    def row_weights(self, row: dict) -> list[float]:
        weights = [float(weight) for weight in self.weights(row)]
        if len(weights) != len(row["labels"]):
            raise ValueError(f"{getattr(self.weights, '__name__', 'weights')} must give one weight per label: "
                             f"{len(weights)} for a row of {len(row['labels'])} labels")
        return weights


class PadPairs:
    """A micro-batch of preference pairs as one batch of rows: the pairs' chosen sides, then their
    rejected sides in the same order, all padded to the longest (one forward runs both). With
    `whole_chosen` (ORPO's SFT term), `sft_labels` too, laid out like the labels: each chosen row's every token,
    its prompt's too (the rejected rows none). `pad_rows` (default PadToLongest): what makes the rows a batch;
    pairs with images: images.PadImageRows, each side given its rendering and the pair's images."""

    def __init__(self, pad_token_id: int, whole_chosen: bool = False, pad_rows=None):
        self.pad_rows = pad_rows or PadToLongest(pad_token_id)
        self.whole_chosen = whole_chosen

    def __call__(self, pairs: list[dict]) -> dict:
        images = "images" in pairs[0]
        batch = self.pad_rows([{"input_ids": pair[f"{side}_input_ids"], "labels": pair[f"{side}_labels"],
                                **({"text": pair[f"{side}_text"], "images": pair["images"]} if images else {})}
                               for side in ("chosen", "rejected") for pair in pairs])
        if self.whole_chosen:
            sft = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE)
            sft[len(pairs):] = IGNORE
            batch["sft_labels"] = sft
        if "pair_index" in pairs[0]:  # which pairs these are: where their reference scores are kept
            batch["pair_index"] = torch.tensor([pair["pair_index"] for pair in pairs])
        if "margin" in pairs[0]:  # how much better each chosen reply is (a reward model's margin)
            batch["margin"] = torch.tensor([pair["margin"] for pair in pairs], dtype=torch.float32)
        return batch


class PadFeedback:
    """A micro-batch of KTO's judged replies as one batch of rows: the rows, then their mismatched rows in the same
    order (preferences.WithMismatched), all padded to the longest; `desirable` (a row's label) and `pair_index`
    (where the reference scores of a row and its mismatched row are kept) one a row."""

    def __init__(self, pad_token_id: int):
        self.pad_rows = PadToLongest(pad_token_id)

    def __call__(self, rows: list[dict]) -> dict:
        batch = self.pad_rows([{"input_ids": row["input_ids"], "labels": row["labels"]} for row in rows]
                              + [{"input_ids": row["kl_input_ids"], "labels": row["kl_labels"]} for row in rows])
        batch["desirable"] = torch.tensor([row["label"] for row in rows])
        batch["pair_index"] = torch.tensor([row["pair_index"] for row in rows])
        return batch


def rows_of(batch: dict, rows: slice) -> dict:
    """The micro-batch's `rows`: its tensors of a row each (ids, labels, mask, positions) sliced, the others
    (target positions, a pair's figures) kept."""
    return {key: value[rows] if torch.is_tensor(value) and value.dim() > 1 else value for key, value in batch.items()}


class WithTargetPositions:
    """`collate`'s batches with `target_positions` added: the positions where some row has a target
    (`positions_with_targets`), found on the CPU from the labels `collate` gave, so that the training step
    need not wait for the device to learn them. With `unpadded_without_mask`, a batch whose attention mask
    masks nothing (no row padded) comes without it: the model then runs plain causal attention rather than
    first asking the device whether the mask can be skipped (a wait per forward)."""

    def __init__(self, collate, unpadded_without_mask: bool = False):
        self.collate = collate
        self.unpadded_without_mask = unpadded_without_mask

    def __call__(self, rows: list[dict]) -> dict:
        batch = self.collate(rows)
        batch["target_positions"] = positions_with_targets(trained_targets(batch))
        mask = batch.get("attention_mask")
        if self.unpadded_without_mask and mask is not None and bool(mask.all()):
            del batch["attention_mask"]
        return batch


class SequenceSlice:
    """Sequence parallel: this rank's slice of every sequence of `collate`'s micro-batches, `rank` of the `size`
    ranks that share them. The batch is padded to a multiple of `size` positions; the rank keeps its
    `length / size` positions of `input_ids` and `position_ids` (numbered in the whole sequence: the attention
    gathers the slices back) and of `labels` one more, so that `labels[:, 1:]` are the targets of exactly its
    positions, the next slice's first token included (`loss_weights`, laid out like the labels, the same). No
    attention mask: the attention over the gathered sequence is causal, and a row's padding, at its end, is
    attended to by nothing real. Its target positions are its slice's own."""

    def __init__(self, collate, rank: int, size: int):
        self.collate, self.rank, self.size = collate, rank, size

    def __call__(self, rows: list[dict]) -> dict:
        batch = self.collate(rows)
        labels = batch.pop("labels")
        count, length = labels.shape
        piece = -(-length // self.size)  # positions per rank
        start, end = self.rank * piece, (self.rank + 1) * piece
        extra = piece * self.size - length
        positions = batch.pop("position_ids", None)
        weights = batch.pop("loss_weights", None)
        sft_labels = batch.pop("sft_labels", None)
        if positions is None:
            positions = torch.arange(length).expand(count, length)
        sliced = {}
        for key, value in batch.items():  # the sequences' tensors sliced; the batch's others (none here) kept
            if key in ("attention_mask", "target_positions"):
                continue
            sequence = torch.is_tensor(value) and value.dim() > 1 and value.shape[1] == length
            sliced[key] = torch.nn.functional.pad(value, (0, extra))[:, start:end] if sequence else value
        # padding: positions counting on, so that the gathered positions still rise along each row
        sliced["position_ids"] = torch.cat([positions, positions[:, -1:] + torch.arange(1, extra + 1)], 1)[:, start:end]
        sliced["labels"] = torch.nn.functional.pad(labels, (0, extra + 1), value=IGNORE)[:, start:end + 1]
        if weights is not None:  # laid out like the labels: the same slice, so the weights of its own targets
            sliced["loss_weights"] = torch.nn.functional.pad(weights, (0, extra + 1))[:, start:end + 1]
        if sft_labels is not None:  # (ORPO's: laid out like the labels too)
            sliced["sft_labels"] = torch.nn.functional.pad(sft_labels, (0, extra + 1), value=IGNORE)[:, start:end + 1]
        sliced["target_positions"] = positions_with_targets(trained_targets(sliced))
        return sliced


def make_loaders(train, evaluation, collate, batch_size: int, workers: int | None = None):
    """Shuffled training batches (the ragged last batch dropped) and ordered evaluation batches,
    each micro-batch made by `collate` (a list of rows -> a dict of tensors), with its target positions
    (`WithTargetPositions`; training batches without an attention mask where no row is padded).

    On a GPU, `workers` processes (default 2) collate the next batches while the GPU computes and
    pinned memory lets the copy to the GPU overlap too; on CPU the workers would only take cores
    from the ranks, so the default there is 0.
    """
    on_gpu = torch.cuda.is_available()
    workers = (2 if on_gpu else 0) if workers is None else workers
    common = dict(batch_size=batch_size, num_workers=workers, pin_memory=on_gpu, persistent_workers=workers > 0)
    train_loader = DataLoader(train, shuffle=True, drop_last=True,
                              collate_fn=WithTargetPositions(collate, unpadded_without_mask=True), **common)
    eval_loader = DataLoader(evaluation, shuffle=False, collate_fn=WithTargetPositions(collate), **common)
    return train_loader, eval_loader


def target_tokens(batch: dict) -> torch.Tensor:
    """How many tokens of the batch are predicted and scored (labels are shifted by one); of ORPO's batches, the
    tokens its SFT term is a mean over (`sft_labels`)."""
    return (batch.get("sft_labels", batch["labels"])[:, 1:] != IGNORE).sum()


def trained_targets(batch: dict) -> torch.Tensor:
    """The batch's targets (labels shifted by one), with ORPO's `sft_labels` where a row has them."""
    targets = batch["labels"][:, 1:]
    if "sft_labels" not in batch:
        return targets
    sft = batch["sft_labels"][:, 1:]
    return torch.where(sft != IGNORE, sft, targets)


def target_weights(weights: torch.Tensor | None) -> torch.Tensor | None:
    """A batch's `loss_weights` (laid out like its labels) for its targets, `labels[:, 1:]`; None without them."""
    return None if weights is None else weights[:, 1:]


def positions_with_targets(targets: torch.Tensor) -> torch.Tensor:
    """The sequence positions where some row of `targets` (labels shifted by one) has a target: the
    only positions the loss needs logits for."""
    return (targets != IGNORE).any(0).nonzero().squeeze(1).cpu()


def optimizer_steps(train_loader, grad_accum: int, start_step: int = 0):
    """Endless stream of (epoch, [grad_accum micro-batches]) from `start_step` on.

    An epoch's ragged tail is dropped, and a resumed run sees exactly the batches that the
    uninterrupted run would have seen.
    """
    from accelerate import skip_first_batches

    epoch, done = divmod(start_step, steps_per_epoch(len(train_loader), grad_accum))
    while True:
        loader = skip_first_batches(train_loader, done * grad_accum) if done else train_loader
        loader.set_epoch(epoch)  # the shuffle order depends on the seed and the epoch only
        group = []
        for batch in without_touching_the_global_rng(loader):
            group.append(batch)
            if len(group) == grad_accum:
                yield epoch, group
                group = []
        epoch, done = epoch + 1, 0


def without_touching_the_global_rng(loader):
    """Iterate `loader`; starting an iterator draws from torch's global RNG (the workers' base
    seed), which would shift every dropout mask after a resume. The draw is undone here, so a
    resumed run and an uninterrupted one see the same random numbers."""
    iterator = iter(loader)
    with torch.random.fork_rng(devices=[]):
        first = next(iterator, None)
    if first is None:
        return
    yield first
    yield from iterator


def say_steps(accelerator, examples: int, args, data_parallel: int, unit: str = "rows") -> None:
    """The `steps:` line, printed once (the main process); every rank refuses a set too small for one step."""
    line = steps_line(examples, args, data_parallel, accelerator.num_processes, unit)
    if accelerator.is_main_process:
        print(line, flush=True)


def steps_line(examples: int, args, data_parallel: int, processes: int, unit: str = "rows") -> str:
    """How the run's step count comes about: --max-steps, or --epochs times the steps the training `unit`s
    fill, and what an epoch leaves out (the recipes count it the same way: ragged batches dropped)."""
    per_step = args.batch_size * args.grad_accum * data_parallel
    epoch = steps_per_epoch(examples // args.batch_size // data_parallel, args.grad_accum)
    ranks = "processes" if data_parallel == processes else "data-parallel groups"
    batch = f"{per_step:,} {unit} (--batch-size {args.batch_size} x --grad-accum {args.grad_accum} x {data_parallel} {ranks})"
    if args.max_steps:
        return f"steps: {args.max_steps:,} (--max-steps); an epoch of {examples:,} training {unit} is {epoch:,} steps of {batch}"
    left = examples - epoch * per_step
    leftover = f"; the {left:,} that do not fill a step sit out each epoch (each shuffles anew)" if left else ""
    return (f"steps: {math.ceil(args.epochs * epoch):,} = --epochs {args.epochs:g} x {epoch:,} steps of {batch} "
            f"over {examples:,} training {unit}{leftover}")


def steps_per_epoch(batches_per_process: int, grad_accum: int) -> int:
    steps = batches_per_process // grad_accum
    if steps == 0:
        refuse(f"one optimizer step needs --grad-accum {grad_accum} micro-batches per process, but the "
               f"training data gives only {batches_per_process} per process; lower --batch-size or --grad-accum, "
               "or give more rows (or launch fewer processes)")
    return steps
