"""Fault injection for tests: real crashes and real bad numbers at a chosen step.

Set MIXPREC_FAULTS to a comma-separated list of name=step (a name may come more than once), e.g.
`MIXPREC_FAULTS=kill_at_step=12` (SIGKILL after optimizer step 12), `kill_during_save=10` (SIGKILL
after the checkpoint of step 10 is written but before it is published), `pause_at_step=20` (after step
20, wait for SIGUSR1/SIGTERM: how the preemption tests signal a run that is surely mid-training; see
mixprec/preemption.py) or `tracker_error=20` (every experiment tracker raises when asked to log step 20).
Unset in normal runs.

Bad numbers, made where they would really arise (`attach` adds hooks only when one is asked for):
- `nan_loss_at_step=N`: the model's output (the logits) is NaN in the training forward passes of
  optimizer step N, so the loss is NaN;
- `inf_grad_at_step=N`: one element of the first parameter's gradient is +inf in step N's backward passes
  (before any all-reduce, clipping or unscaling).
"""
from __future__ import annotations

import os
import signal
from typing import Callable

import torch


def _faults() -> set[tuple[str, int]]:
    spec = os.environ.get("MIXPREC_FAULTS", "")
    out = set()
    for item in filter(None, spec.split(",")):
        name, _, step = item.partition("=")
        out.add((name.strip(), int(step)))
    return out


def active(name: str, step: int) -> bool:
    return (name, step) in _faults()


def maybe_kill(name: str, step: int) -> None:
    if active(name, step):
        print(f"[fault injection] {name}={step}: SIGKILL", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def attach(model: torch.nn.Module, next_step: Callable[[], int]) -> None:
    """Hooks for the bad-number faults; `next_step()` is the number of the optimizer step being computed."""
    names = {name for name, _ in _faults()}
    if "nan_loss_at_step" in names:
        def nan_output(module, inputs, output):
            if module.training and active("nan_loss_at_step", next_step()):
                return output * float("nan")
            return output
        model.register_forward_hook(nan_output)
    if "inf_grad_at_step" in names:
        def inf_grad(grad):
            if not active("inf_grad_at_step", next_step()):
                return grad
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad
        next(p for p in model.parameters() if p.requires_grad).register_hook(inf_grad)
