"""What the recipe runs on: device type, CPU features and name, threads per process."""
from __future__ import annotations

import os
import platform

import torch


def device_type() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def _cpuinfo(key: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    return set((_cpuinfo("flags") or "").split())


def cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def set_cpu_threads(requested: int | None) -> int:
    """Threads for this process's CPU math. `accelerate launch` sets OMP_NUM_THREADS=1 unless told `--cpu`;
    by default (None) each process gets its share of the usable cores instead."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = requested or max(1, usable_cores() // local)
    torch.set_num_threads(threads)
    return threads


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} x{torch.cuda.device_count()} per node"
    if device.type == "cpu":
        return f"{cpu_name()} ({torch.get_num_threads()} threads per process)"
    return device.type


def machine_line() -> str:
    """The hardware a benchmark ran on, for its report: the GPU, or the CPU and its cores; torch and Python."""
    if torch.cuda.is_available():
        where = f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    else:
        where = f"{cpu_name()}, {usable_cores()} cores, no GPU"
    return f"{where}, torch {torch.__version__}, Python {platform.python_version()}"
