"""AdamW and the learning-rate schedule: linear warmup, then constant, linear or cosine decay."""
from __future__ import annotations

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


def scheduler(optimizer, warmup: int, total: int, schedule: str, min_ratio: float, num_processes: int):
    """A LambdaLR over optimizer steps.

    Once prepared, Accelerate's scheduler wrapper calls `step()` `num_processes` times per optimizer
    step (and not at all when the GradScaler skipped the step), so the lambda's tick is divided back.
    """
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda tick: lr_factor(tick // num_processes, warmup, total, schedule, min_ratio))
