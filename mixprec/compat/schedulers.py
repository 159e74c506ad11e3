"""A learning-rate scheduler's peak rates, changed on resume (torch 2.13; canary: tests/test_compat.py).

torch's LR schedulers keep the peak rate of each parameter group in `base_lrs`, which no public method sets;
a resume with a new --lr must change it, or the schedule would go on from the checkpoint's old peak. The
change goes through `state_dict`/`load_state_dict`, whose dict holds `base_lrs` under that name.
"""
from __future__ import annotations


def peak_lrs(scheduler) -> list[float]:
    return list(scheduler.state_dict()["base_lrs"])


def set_peak_lrs(scheduler, lrs: list[float]) -> None:
    state = scheduler.state_dict()
    state["base_lrs"] = list(lrs)
    scheduler.load_state_dict(state)
