"""The loss every script trains and judges with: `loss_fn` is cross-entropy computed in fp32 whatever the autocast
dtype (the lesson's rule: reductions in fp32); `per_row` gives each validation row's summed loss, hits and
targets. The validation pass that uses them is mixprec.training.validation.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F



def loss_fn(logits: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor | None = None,
            reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy in fp32 for classes (B, C) or tokens (B, T, V); label -100 has no loss. The mean over the
    batch's targets; with `targets` (mixprec.data.batches.weighted: the optimizer step's target tokens on all
    processes per micro-batch), the batch's sum divided by it: token-weighted over the whole step."""
    if targets is None:
        return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction=reduction)
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="sum") / targets


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """float64 for sums of losses, where the device has it (MPS does not)."""
    return torch.float32 if device.type == "mps" else torch.float64


def per_row(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss, hits and targets of each row: a class is one target; a row of tokens sums over its target tokens
    (label -100: none), so that the validation loss is a mean over target tokens, however rows differ."""
    loss = loss_fn(logits, labels, reduction="none").view(labels.shape)
    hit = (logits.argmax(-1) == labels).float()
    if labels.dim() == 1:
        return loss, hit, torch.ones_like(loss)
    target = labels != -100
    return loss.sum(1), (hit * target).sum(1), target.sum(1).float()
