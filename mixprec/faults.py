"""Fault injection for tests: real crashes and real bad numbers at a chosen step.

Set MIXPREC_FAULTS to a comma-separated list of name=step, for example
`MIXPREC_FAULTS=kill_at_step=12` (SIGKILL after optimizer step 12) or `kill_during_save=10` (SIGKILL
after the checkpoint of step 10 is written but before it is published) or `tracker_error=20` (every
experiment tracker raises when asked to log step 20). Unset in normal runs.
"""
from __future__ import annotations

import os
import signal


def _faults() -> dict[str, int]:
    spec = os.environ.get("MIXPREC_FAULTS", "")
    out = {}
    for item in filter(None, spec.split(",")):
        name, _, step = item.partition("=")
        out[name.strip()] = int(step)
    return out


def active(name: str, step: int) -> bool:
    return _faults().get(name) == step


def maybe_kill(name: str, step: int) -> None:
    if active(name, step):
        print(f"[fault injection] {name}={step}: SIGKILL", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
