"""Accelerate's behaviours that the recipes work around (seen in accelerate 1.15.0; canaries: tests/test_compat.py)."""
from __future__ import annotations

import contextlib

import torch

from ..unwrap import unwrap


def fp16_on_cpu(accelerator, scaler_kwargs: dict) -> bool:
    """`Accelerator(mixed_precision="fp16")` on a CPU trains in fp32 without a word: no autocast
    (`native_amp` False) and no GradScaler. Make fp16 real there: fp16 autocast and torch's CPU GradScaler.
    Returns True when it had to."""
    if accelerator.device.type != "cpu" or accelerator.mixed_precision != "fp16" or accelerator.scaler is not None:
        return False
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
    return True


@contextlib.contextmanager
def autocast_off(model, accelerator, enabled: bool = True):
    """Run `model` without autocast inside this block.

    `accelerator.prepare` replaces the model instance's `forward` with an autocast-wrapped one, and an outer
    `torch.autocast(enabled=False)` cannot switch off an autocast entered inside it. So the wrapped `forward`
    is taken off the instance for the block (the class's own `forward` runs) and put back afterwards.
    """
    if not enabled:
        yield
        return
    raw = unwrap(accelerator, model)
    patched = raw.__dict__.pop("forward", None)
    try:
        with torch.autocast(device_type=accelerator.device.type, enabled=False):
            yield
    finally:
        if patched is not None:
            raw.forward = patched


def restart_accumulation(accelerator) -> None:
    """`load_state` restores Accelerate's micro-batch counter (`step`, kept in random_states_N.pkl), and
    `accumulate()` syncs gradients when `step % gradient_accumulation_steps == 0`. The recipe checkpoints only
    at the end of an accumulation window, and a resume may split the global batch differently (another
    accumulation count): the counter starts again from 0, at a window's start."""
    accelerator.step = 0
