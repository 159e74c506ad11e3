"""Accelerate's per-step calls without the per-call costs that do nothing for these recipes (accelerate 1.15.0;
canaries and same-result tests: tests/test_compat.py).

On a small model every call of the textbook loop counts: the lesson's MLP steps in about 2-3 ms on the 2-core
AMD EPYC, and `benchmarks/loop_calls.py` times each of Accelerate's calls against its plain PyTorch
counterpart in the same process. What `skip_per_step_overheads` changes, each named by its upstream cost:

- `AcceleratedOptimizer.step` asks importlib whether `lomo_optim` is installed (`is_lomo_available`) on
  every optimizer step: asked once (functools.cache). With one process and no GradScaler it also reads
  ACCELERATE_USE_FSDP from the environment and checks for XLA on every step: `_optimizer_step` steps the
  optimizer directly in that case (the only thing Accelerate's step does there), and leaves anything else
  (a GradScaler, several processes, DeepSpeed, XLA, LOMO optimizers) to Accelerate;
- `AcceleratedOptimizer.zero_grad` asks `inspect.signature` whether the wrapped optimizer's `zero_grad`
  takes `set_to_none` on every call: asked once per function (`_zero_grad`, otherwise Accelerate's code);
- `Accelerator.accumulate` is a generator context manager that builds an ExitStack on every micro-batch;
  with one process (distributed type NO: there is no gradient sync to skip) all it does is count the
  micro-batch (`_do_sync`), and `_accumulate` does just that (otherwise Accelerate's own);
- `Accelerator.autocast` wraps the context manager that it gets from `get_mixed_precision_context_manager`
  (torch.autocast, or nullcontext in fp32) in a generator context manager on every micro-batch: `_autocast`
  enters and leaves the same context manager without the generator;
- `Accelerator.backward` divides the loss by `gradient_accumulation_steps` even when that is 1: a kernel
  and an autograd node for `loss / 1` on every step. Without accumulation (and outside DeepSpeed and
  Megatron, and without LOMO's `learning_rate`) `_backward` leaves the division out; x / 1 is x exactly,
  so the gradients are the same bits;
- `Accelerator.clip_grad_norm_` parses a version string (`is_torch_version`) and sorts the parameters into
  DTensor meshes on every call; with one process (no DTensor gradients) `_clip_grad_norm_` unscales and
  calls torch's `clip_grad_norm_` on the same parameters, as Accelerate ends up doing;
- `Accelerator.unwrap_model` (evaluation, the final save) tests for a DeepSpeed engine by importing
  DeepSpeed whenever it is installed (`accelerate.utils.other.is_deepspeed_available`): about 1.7 s and a
  warning line in a plain run. Only a DeepSpeed launch can hold such an engine, so outside one the
  check answers False.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch

_REPLACED = ("accumulate", "autocast", "backward", "clip_grad_norm_")  # Accelerator's; originals kept alongside


def skip_per_step_overheads(deepspeed: bool) -> None:
    """Apply the changes in the module docstring (idempotent)."""
    import accelerate
    import accelerate.optimizer
    import accelerate.utils.other as other

    if not hasattr(accelerate.optimizer.is_lomo_available, "cache_info"):
        accelerate.optimizer.is_lomo_available = functools.cache(accelerate.optimizer.is_lomo_available)
    wrapper = accelerate.optimizer.AcceleratedOptimizer
    if not hasattr(wrapper, "_mixprec_upstream_step"):
        wrapper._mixprec_upstream_step = wrapper.step
        wrapper.step = _optimizer_step
    wrapper.zero_grad = _zero_grad
    accelerator = accelerate.Accelerator
    for name in _REPLACED:
        if not hasattr(accelerator, f"_mixprec_upstream_{name}"):
            setattr(accelerator, f"_mixprec_upstream_{name}", getattr(accelerator, name))
            setattr(accelerator, name, globals()[f"_{name}"])
    original = getattr(other, "_mixprec_is_deepspeed_available", other.is_deepspeed_available)
    other._mixprec_is_deepspeed_available = original
    other.is_deepspeed_available = original if deepspeed else (lambda: False)


def _one_process(distributed_type) -> bool:
    return distributed_type.name == "NO"


class _CountMicroBatch(contextlib.ContextDecorator):
    """`Accelerator.accumulate` for one process: count the micro-batch (sync_gradients), nothing to skip. A
    decorator too, as Accelerate's is."""

    __slots__ = ("accelerator",)

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def __enter__(self):
        self.accelerator._do_sync()

    def __exit__(self, *exc):
        return False


def _accumulate(self, *models):
    """accelerate 1.15's Accelerator.accumulate; with one process, only its micro-batch count."""
    if _one_process(self.distributed_type):
        return _CountMicroBatch(self)
    return self._mixprec_upstream_accumulate(*models)


class _Autocast(contextlib.ContextDecorator):
    """Accelerate's autocast context manager (torch.autocast, or nullcontext in fp32), entered and left; `with
    ... as x` gives None, as Accelerate's generator does. As a decorator each call gets a fresh one."""

    __slots__ = ("accelerator", "handler", "context")

    def __init__(self, accelerator, handler):
        self.accelerator, self.handler, self.context = accelerator, handler, None

    def _recreate_cm(self):
        return _Autocast(self.accelerator, self.handler)

    def __enter__(self):
        from accelerate.utils import get_mixed_precision_context_manager

        self.context = get_mixed_precision_context_manager(self.accelerator.native_amp, self.handler)
        self.context.__enter__()

    def __exit__(self, *exc):
        return self.context.__exit__(*exc)


def _autocast(self, autocast_handler=None):
    """accelerate 1.15's Accelerator.autocast, without the generator around its context manager."""
    return _Autocast(self, self.autocast_handler if autocast_handler is None else autocast_handler)


def _backward(self, loss, **kwargs):
    """accelerate 1.15's Accelerator.backward, without `loss / 1` when there is no accumulation."""
    if self.gradient_state.num_steps != 1 or kwargs.get("learning_rate") is not None or \
            self.distributed_type.name in ("DEEPSPEED", "MEGATRON_LM"):
        return self._mixprec_upstream_backward(loss, **kwargs)
    if self.scaler is not None:
        self.scaler.scale(loss).backward(**kwargs)
    else:
        loss.backward(**kwargs)


def _clip_grad_norm_(self, parameters, max_norm, norm_type=2):
    """accelerate 1.15's Accelerator.clip_grad_norm_; with one process, unscale and torch's clip_grad_norm_."""
    if not _one_process(self.distributed_type):
        return self._mixprec_upstream_clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
    self.unscale_gradients()
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)


def _optimizer_step(self, closure=None):
    """accelerate 1.15's AcceleratedOptimizer.step; with one process and no GradScaler, the optimizer's step
    at the end of an accumulation window."""
    import accelerate.optimizer

    if self.scaler is not None or accelerate.optimizer.is_lomo_available() or \
            not _one_process(self.accelerator_state.distributed_type):
        return self._mixprec_upstream_step(closure)
    if self.gradient_state.sync_gradients:
        self.optimizer.step(closure)


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
