"""Evaluation on the held-out rows: token-mean loss and exact match of the whole target; for preference
pairs, the pair-mean loss and how often and by how much the chosen side wins."""

from __future__ import annotations

import torch

from ..data.batches import positions_with_targets
from ..data.formats import IGNORE


@torch.no_grad()
def evaluate(accelerator, model, eval_loader, token_losses, stages) -> dict:
    """`eval_loss`: the recipe's `token_losses` over all target tokens (the quantity the training loss is);
    `eval_exact_match`: rows whose every target token is the argmax. `stages`: pipeline parallel's
    `pipeline.Pipeline` (None for every other strategy), which runs the batches through its stages.

    Every rank runs every batch (FSDP and ZeRO-3 forwards are collective); `gather_for_metrics`
    drops the rows accelerate repeated to even out the last batch.
    """
    if stages:  # pipeline parallel: the batch's forward runs through the stages
        return stages.evaluate(eval_loader, token_losses)
    model.eval()
    loss_sum = tokens = exact = rows = 0.0
    for batch in eval_loader:
        labels = batch["labels"][:, 1:]  # position t predicts token t + 1
        positions = positions_with_targets(labels)  # the LM head runs where a row has a target
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       logits_to_keep=positions).logits.float()
        per_row = accelerator.gather_for_metrics(row_figures(logits, labels[:, positions].to(logits.device), token_losses))
        loss_sum += per_row[:, 0].sum().item()
        tokens += per_row[:, 1].sum().item()
        exact += per_row[:, 2].sum().item()
        rows += per_row.shape[0]
    model.train()
    return {"eval_loss": loss_sum / max(tokens, 1), "eval_exact_match": exact / max(rows, 1)}


def row_figures(logits: torch.Tensor, labels: torch.Tensor, token_losses) -> torch.Tensor:
    """Per row: summed target-token loss, target tokens, 1 if every target token is the argmax."""
    targets = labels != IGNORE
    token_loss = token_losses(logits, labels)
    correct = ((logits.argmax(-1) == labels) | ~targets).all(dim=1)
    return torch.stack([token_loss.sum(1), targets.sum(1).float(), correct.float()], dim=1)


def batch_figures(logits: torch.Tensor, labels: torch.Tensor, token_losses) -> torch.Tensor:
    """(loss sum, target tokens, exact rows, rows) of a batch: logits at every position but the last."""
    per_row = row_figures(logits[:, :-1], labels, token_losses)
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
