"""Evaluation on the held-out rows: token-mean loss and exact match of the whole target."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batches import positions_with_targets
from .formats import IGNORE


@torch.no_grad()
def evaluate(accelerator, model, eval_loader) -> dict:
    """`eval_loss` over all target tokens; `eval_exact_match`: rows whose every target token is the argmax.

    Every rank runs every batch (FSDP and ZeRO-3 forwards are collective); `gather_for_metrics`
    drops the rows accelerate repeated to even out the last batch.
    """
    model.eval()
    loss_sum = tokens = exact = rows = 0.0
    for batch in eval_loader:
        labels = batch["labels"][:, 1:]  # position t predicts token t + 1
        positions = positions_with_targets(labels)  # the LM head runs where a row has a target
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       logits_to_keep=positions).logits.float()
        labels = labels[:, positions].to(logits.device)
        targets = labels != IGNORE
        token_loss = F.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none") * targets
        correct = ((logits.argmax(-1) == labels) | ~targets).all(dim=1)
        per_row = torch.stack([token_loss.sum(1), targets.sum(1).float(), correct.float()], dim=1)
        per_row = accelerator.gather_for_metrics(per_row)
        loss_sum += per_row[:, 0].sum().item()
        tokens += per_row[:, 1].sum().item()
        exact += per_row[:, 2].sum().item()
        rows += per_row.shape[0]
    model.train()
    return {"eval_loss": loss_sum / max(tokens, 1), "eval_exact_match": exact / max(rows, 1)}


@torch.no_grad()
def probe_logits(model, batch: dict) -> torch.Tensor:
    """Logits of the trained model on a fixed batch, to compare with the saved model reloaded."""
    model.eval()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float().cpu()
    model.train()
    return logits
