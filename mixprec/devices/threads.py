"""CPU threads: how many, and how they wait. No torch import here: `quiet_waiting` must run before torch loads.

- Waiting: OpenMP's threads spin while they wait for work (GNU OpenMP's default, ACTIVE). On a machine with
  few cores and another busy process, spinning threads take turns with that process and a step can take
  several times longer. `quiet_waiting` sets OMP_WAIT_POLICY=PASSIVE (they sleep instead) unless the user
  chose a policy. The results do not depend on it.
- How many (`choose`): the usable cores shared by the processes of this machine; but one thread when the
  model's work per micro-batch is so small that splitting it costs more than it saves (the lesson's MLP:
  0.01 GFLOP per batch), which also leaves the other cores to whatever else runs. It depends on the model, not
  on the machine's load: beside 1, 3 and 6 spinning processes on 2 cores, fewer threads than cores did not make
  gpt_tiny or a tiny BERT faster (the kernel shares the cores per thread: a second thread is a second share;
  benchmarks/threads.py, docs/performance.md "CPU threads"). A resume reuses the count its checkpoint recorded
  (`recorded`): bf16 results differ, slightly, between thread counts, and a resumed run on a machine with
  another number of cores continues the same numbers. `--cpu_threads N` decides instead.
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


def choose(requested: int | None, gflop_per_batch: float | None = None,
           recorded: int | None = None) -> tuple[int, str]:
    """(threads, why) for this process. `gflop_per_batch` None: a provisional count for start-up, before the
    model is known."""
    if requested:
        return requested, "--cpu_threads"
    if recorded:
        return recorded, "as recorded by the checkpoint (the same arithmetic as the run it continues)"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = usable_cores()
    share = max(1, cores // local)
    if gflop_per_batch is not None and gflop_per_batch < SMALL_WORK_GFLOP and share > 1:
        return 1, (f"{gflop_per_batch:.2g} GFLOP per micro-batch is too little to split over {share} cores "
                   f"(--cpu_threads N to choose)")
    return share, f"{cores} usable cores / {local} process(es) on this machine"
