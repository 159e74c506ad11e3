"""The loss every script trains and judges with, and the validation pass.

`loss_fn` is cross-entropy computed in fp32 whatever the autocast dtype (the lesson's rule: reductions in fp32).
`evaluate` runs the model under `model.eval()` and `torch.no_grad()`, in fp32 unless asked otherwise, over
this process's share of the validation rows (`data.batches.EvalBatches`), and sums the per-row loss and
accuracy over all processes: every row counts once, padding (weight 0) not at all. With several processes the
model's buffers (BatchNorm's running statistics, which each process updates on its own batches) are first
taken from process 0, as DDP does before each training forward: every process evaluates the model that
model.safetensors holds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import compat
from .unwrap import unwrap


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


def upcast(model, accelerator, fp32: bool):
    """fp32 evaluation of bf16 master weights (--master_weights bf16): upcast for the pass (DeepSpeed: its own)."""
    from .precision.master_weights import upcast as upcast_weights

    return upcast_weights(unwrap(accelerator, model), fp32 and accelerator.distributed_type.name != "DEEPSPEED")


def evaluate(model, batches, accelerator, fp32: bool = True) -> dict:
    """{'val_loss', 'val_accuracy'} over the whole validation set (all processes)."""
    dtype = accumulation_dtype(accelerator.device)
    sums = torch.zeros(3, dtype=dtype, device=accelerator.device)  # loss, hits, targets (rows or tokens)
    if accelerator.num_processes > 1:
        for buffer in unwrap(accelerator, model).buffers():
            if buffer.is_floating_point():
                torch.distributed.broadcast(buffer.data, src=0)
    model.eval()
    with torch.no_grad(), compat.autocast_off(model, accelerator, enabled=fp32), upcast(model, accelerator, fp32):
        for batch in batches:
            loss, hit, targets = per_row(model(batch["inputs"]), batch["labels"])
            weight = batch["weight"].to(dtype)
            sums += torch.stack([(loss.to(dtype) * weight).sum(), (hit.to(dtype) * weight).sum(),
                                 (targets.to(dtype) * weight).sum()])
    model.train()
    if accelerator.num_processes > 1:
        sums = accelerator.reduce(sums, "sum")
    loss, hits, targets = sums.tolist()
    return {"val_loss": loss / targets, "val_accuracy": hits / targets}
