"""CPU threads: how many, and how they wait. No torch import here: `quiet_waiting` must run before torch loads.

- Waiting: OpenMP's threads spin while they wait for work (GNU OpenMP's default, ACTIVE). On a machine with
  few cores and another busy process, spinning threads take turns with that process and a step can take
  several times longer. `quiet_waiting` sets OMP_WAIT_POLICY=PASSIVE (they sleep instead) unless the user
  chose a policy. The results do not depend on it.
- How many (`choose`): the usable cores shared by the processes of this machine; but one thread when the
  model's work per micro-batch is so small that splitting it costs more than it saves (the lesson's MLP:
  0.01 GFLOP per batch), which also leaves the other cores to whatever else runs; and no more threads than
  the cores other processes leave free when the run starts (`busy_cores`: the kernel's count of running
  processes, sampled a few times). A thread that has to wait for a busy core makes every parallel operation
  wait for it: a tiny BERT classifier beside four busy processes on 2 cores took 1.6-13 s a step with 2 threads
  and 0.14 s with 1 (benchmarks/threads.py --busy, docs/performance.md "CPU threads"). A resume reuses the count
  its checkpoint recorded (`recorded`): bf16 results differ, slightly, between thread counts, and a resumed run
  continues the same numbers. `--cpu_threads N` decides instead; MIXPREC_LOAD_AWARE_THREADS=0 leaves the load out
  (a count that depends on the model alone: for a test suite that compares separate runs bit for bit on a shared
  machine).
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


def busy_cores(samples: int = 5, gap_s: float = 0.005) -> int:
    """Processes running now besides this one (Linux: /proc/stat's procs_running, this process counted once: the
    median of `samples` reads `gap_s` apart, about 25 ms); 0 where it cannot be read."""
    import statistics
    import time

    counts = []
    for i in range(samples):
        try:
            with open("/proc/stat") as f:
                counts += [int(line.split()[1]) for line in f if line.startswith("procs_running")]
        except (OSError, ValueError, IndexError):
            return 0
        if i + 1 < samples:
            time.sleep(gap_s)
    return max(0, int(statistics.median(counts)) - 1) if counts else 0


def choose(requested: int | None, gflop_per_batch: float | None = None,
           recorded: int | None = None) -> tuple[int, str]:
    """(threads, why) for this process. `gflop_per_batch` None: a provisional count for start-up, before the
    model is known (no load sampled)."""
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
    if gflop_per_batch is not None and share > 1 and os.environ.get("MIXPREC_LOAD_AWARE_THREADS", "1") != "0":
        others = max(0, busy_cores() - (local - 1))  # the launch's other processes are not others
        free = max(1, (cores - others) // local)
        if free < share:
            return free, (f"{others} other process{'es' if others != 1 else ''} running on {cores} usable cores at "
                          f"start: {free} thread{'s' if free != 1 else ''} per process, so that no thread waits "
                          f"for a busy core (--cpu_threads N to choose)")
    return share, f"{cores} usable cores / {local} process(es) on this machine"
