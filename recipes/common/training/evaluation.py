"""Evaluation on the held-out rows: token-mean loss and exact match of the whole target; for preference
pairs, the pair-mean loss and how often and by how much the chosen side wins."""

from __future__ import annotations

import torch

from ..data.batches import target_weights
from ..data.formats import IGNORE
from ..data.images import model_inputs
from ..model.loss_head import figures_of


@torch.no_grad()
def evaluate(accelerator, model, eval_loader, token_losses, head, stages) -> dict:
    """`eval_loss`: the recipe's `token_losses` over all target tokens (the quantity the training loss is);
    `eval_exact_match`: rows whose every target token is the argmax. The collator's weights, where it gives
    some, weigh each token's loss as in training (the same denominator). `head`: the run's `loss_head.LossHead`,
    which gives the logits a chunk of positions at a time. `stages`: pipeline parallel's `pipeline.Pipeline`
    (None for every other strategy), which runs the batches through its stages.

    Every rank runs every batch (FSDP and ZeRO-3 forwards are collective); `gather_for_metrics`
    drops the rows accelerate repeated to even out the last batch.
    """
    if stages:  # pipeline parallel: the batch's forward runs through the stages
        return stages.evaluate(eval_loader, token_losses)
    model.eval()
    loss_sum = tokens = exact = rows = 0.0
    for batch in eval_loader:
        labels, positions = batch["labels"][:, 1:], batch["target_positions"]  # position t predicts token t + 1
        outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                        **model_inputs(batch), **head.forward_arguments(positions))  # (image rows: their pixels)
        per_position = head.apply(lambda logits, chunk_labels, chunk_weights=None:
                                  position_figures(logits, chunk_labels, token_losses, chunk_weights),
                                  outputs, labels, positions, target_weights(batch.get("loss_weights")))
        per_row = accelerator.gather_for_metrics(rows_of(per_position))
        loss_sum += per_row[:, 0].sum().item()
        tokens += per_row[:, 1].sum().item()
        exact += per_row[:, 2].sum().item()
        rows += per_row.shape[0]
    model.train()
    return {"eval_loss": loss_sum / max(tokens, 1), "eval_exact_match": exact / max(rows, 1)}


def position_figures(logits: torch.Tensor, labels: torch.Tensor, token_losses, weights=None) -> torch.Tensor:
    """Per position (laid out like `labels`, 3 figures deep): its loss (weighted by `weights`, laid out like
    `labels`, where the batch has some), 1 where it is a target, 1 where it is not a target or its target is
    the argmax."""
    targets = labels != IGNORE
    correct = (logits.argmax(-1) == labels) | ~targets
    losses = figures_of(token_losses, logits.float(), labels, weights)
    return torch.stack([losses, targets.float(), correct.float()], dim=-1)


def rows_of(per_position: torch.Tensor) -> torch.Tensor:
    """Per row: summed target-token loss, target tokens, 1 if every target token is the argmax."""
    return torch.stack([per_position[..., 0].sum(1), per_position[..., 1].sum(1), per_position[..., 2].prod(1)], 1)


def batch_figures(logits: torch.Tensor, labels: torch.Tensor, token_losses, weights=None) -> torch.Tensor:
    """(loss sum, target tokens, exact rows, rows) of a batch: logits at every position but the last (`weights`:
    laid out like `labels`, or None)."""
    per_row = rows_of(position_figures(logits[:, :-1], labels, token_losses, weights))
    return torch.cat([per_row.sum(0), per_row.new_tensor([per_row.shape[0]])]).double()


@torch.no_grad()
def evaluate_pairs(accelerator, model, eval_loader, pair_figures) -> dict:
    """The held-out pairs under the recipe's own loss. `pair_figures(batch)` gives, per pair, its loss and
    the rewards of its chosen and rejected sides (a tensor of pairs x 3). Every rank runs every batch;
    `gather_for_metrics` drops the pairs accelerate repeated to even out the last batch."""
    model.eval()
    gathered = [accelerator.gather_for_metrics(pair_figures(batch)[:, :3].double()) for batch in eval_loader]
    model.train()
    losses, chosen, rejected = torch.cat(gathered).T
    return {"eval_loss": losses.mean().item(), "eval_rewards/accuracies": (chosen > rejected).double().mean().item(),
            "eval_rewards/margins": (chosen - rejected).mean().item()}


@torch.no_grad()
def evaluate_feedback(accelerator, model, eval_loader, row_scores, row_losses) -> dict:
    """The held-out judged replies under KTO's loss, its KL estimate taken over all of them (as training takes it
    over a step's rows). `row_scores(batch)` gives, per row, the policy's and the reference's log-probabilities of
    its reply and of its mismatched row's, and its label (a tensor of rows x 5); `row_losses(logps, reference,
    desirable, kl)` the recipe's losses and rewards. Every rank runs every batch; `gather_for_metrics` drops the
    rows accelerate repeated to even out the last batch."""
    model.eval()
    gathered = [accelerator.gather_for_metrics(row_scores(batch).double()) for batch in eval_loader]
    model.train()
    logps, reference, mismatched, mismatched_reference, desirable = torch.cat(gathered).T
    kl = (mismatched - mismatched_reference).mean().clamp(min=0)
    desirable = desirable.bool()
    losses, rewards = row_losses(logps, reference, desirable, kl)
    figures = {"eval_loss": losses.mean().item(), "eval_kl": kl.item()}
    for name, rows in (("chosen", desirable), ("rejected", ~desirable)):
        if rows.any():
            figures[f"eval_rewards/{name}"] = rewards[rows].mean().item()
    return figures
