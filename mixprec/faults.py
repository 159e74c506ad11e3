"""Fault injection for tests: real crashes and real bad numbers at a chosen step.

Set MIXPREC_FAULTS to a comma-separated list of name=step (a name may come more than once), e.g.
`MIXPREC_FAULTS=kill_at_step=12` (SIGKILL after optimizer step 12), `kill_during_save=10` (SIGKILL
after the checkpoint of step 10 is written but before it is published), `pause_at_step=20` (after step
20, wait for SIGUSR1/SIGTERM: how the preemption tests signal a run that is surely mid-training; see
mixprec/preemption.py) or `tracker_error=20` (every experiment tracker raises when asked to log step 20).
Unset in normal runs.
"""
from __future__ import annotations

import os
import signal


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
