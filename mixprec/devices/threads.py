"""CPU threads: how many, and how they wait. No torch import here: `quiet_waiting` must run before torch loads.

- Waiting: OpenMP's threads spin while they wait for work (GNU OpenMP's default, ACTIVE). On a machine with
  few cores and another busy process, spinning threads take turns with that process and a step can take
  several times longer. `quiet_waiting` sets OMP_WAIT_POLICY=PASSIVE (they sleep instead) unless the user
  chose a policy. The results do not depend on it.
- How many (`choose`): the usable cores shared by the processes of this machine; but one thread when the
  model's work per micro-batch is so small that splitting it costs more than it saves (the lesson's MLP:
  0.01 GFLOP per batch), which also leaves the other cores to whatever else runs. It depends on the model,
  not on the machine's load, so a run and its resume use the same count (results differ, slightly, between
  thread counts). `--cpu_threads N` decides instead.
"""
from __future__ import annotations

import os

SMALL_WORK_GFLOP = 0.1  # training FLOPs per micro-batch (per process) below which one thread is used


def quiet_waiting() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def choose(requested: int | None, gflop_per_batch: float | None = None) -> tuple[int, str]:
    """(threads, why) for this process."""
    if requested:
        return requested, "--cpu_threads"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    share = max(1, usable_cores() // local)
    if gflop_per_batch is not None and gflop_per_batch < SMALL_WORK_GFLOP and share > 1:
        return 1, (f"{gflop_per_batch:.2g} GFLOP per micro-batch is too little to split over {share} cores "
                   f"(--cpu_threads N to choose)")
    return share, f"{usable_cores()} usable cores / {local} process(es) on this machine"
