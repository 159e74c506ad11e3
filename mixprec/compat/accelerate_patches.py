"""Accelerate's behaviours that the recipes work around (seen in accelerate 1.15.0; canaries: tests/test_compat.py)."""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch


def skip_per_step_overheads(deepspeed: bool) -> None:
    """Three costs that do nothing for these recipes:

    - `AcceleratedOptimizer.step` asks importlib whether `lomo_optim` is installed (`is_lomo_available`) on
      every optimizer step; the answer cannot change during a run, so it is asked once (functools.cache);
    - `AcceleratedOptimizer.zero_grad` asks `inspect.signature` whether the wrapped optimizer's `zero_grad`
      takes `set_to_none` on every call (about 0.13 ms a step on the 2-core AMD EPYC, timed once by hand,
      where the lesson's MLP steps in 3-5 ms: docs/benchmarks.md); it is asked once per function
      (`_zero_grad`, otherwise Accelerate's own code);
    - `Accelerator.unwrap_model` (evaluation, the final save) tests for a DeepSpeed engine by importing
      DeepSpeed whenever it is installed (`accelerate.utils.other.is_deepspeed_available`): about 1.7 s and a
      warning line in a plain run. Only a DeepSpeed launch can hold such an engine, so outside one the
      check answers False.
    """
    import accelerate.optimizer
    import accelerate.utils.other as other

    if not hasattr(accelerate.optimizer.is_lomo_available, "cache_info"):
        accelerate.optimizer.is_lomo_available = functools.cache(accelerate.optimizer.is_lomo_available)
    accelerate.optimizer.AcceleratedOptimizer.zero_grad = _zero_grad
    original = getattr(other, "_mixprec_is_deepspeed_available", other.is_deepspeed_available)
    other._mixprec_is_deepspeed_available = original
    other.is_deepspeed_available = original if deepspeed else (lambda: False)


@functools.lru_cache(maxsize=64)
def _takes_set_to_none(function) -> bool:
    return "set_to_none" in inspect.signature(function).parameters


def _zero_grad(self, set_to_none=None):
    """accelerate 1.15's AcceleratedOptimizer.zero_grad, with the signature asked once per function."""
    if self.gradient_state.sync_gradients:
        method = self.optimizer.zero_grad
        if _takes_set_to_none(getattr(method, "__func__", method)):
            self.optimizer.zero_grad(set_to_none=True if set_to_none is None else set_to_none)
        else:
            if set_to_none is not None:
                raise ValueError("`set_to_none` for Optimizer.zero_grad` is not supported by this optimizer.")
            self.optimizer.zero_grad()


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
    raw = accelerator.unwrap_model(model)
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
