"""AdamW and the learning-rate schedule: linear warmup, then constant, linear or cosine decay."""
from __future__ import annotations

import functools
import math

import torch


def adamw(model: torch.nn.Module, lr: float, weight_decay: float, fused: bool | None = None):
    """AdamW with weight decay on matrices only (biases and norm gains are not decayed, as in nanoGPT)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, fused=fused)


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def schedule(warmup: int, total: int, schedule: str, min_ratio: float):
    """The schedule as a function of the 0-based optimizer step: what `scheduler`'s LambdaLR multiplies the
    peak rate by, and what the log reads the last step's rate from."""
    return functools.partial(lr_factor, warmup=warmup, total=total, schedule=schedule, min_ratio=min_ratio)


def scheduler(optimizer, warmup: int, total: int, schedule_name: str, min_ratio: float):
    """A LambdaLR over optimizer steps, stepped by the recipe once per optimizer step, skipped steps included,
    so that it always reaches its end at step `total` (it is not given to `accelerator.prepare`, whose wrapper
    steps it once per process and not on skipped steps)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(warmup, total, schedule_name, min_ratio))
