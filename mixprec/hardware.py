"""What the recipe runs on: device type, CPU features and name, threads per process."""
from __future__ import annotations

import os
import platform

import torch

from .threads import choose, usable_cores


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


NATIVE_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}


def cpu_native(precision: str) -> tuple[bool, str]:
    """Does this CPU compute in `precision` (bf16 or fp16) natively? (answer, why) from its feature flags."""
    flags = sorted(cpu_flags() & set(NATIVE_FLAGS[precision]))
    name = {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16", "avx512_fp16": "AVX512-FP16", "amx_fp16": "AMX-FP16"}
    if flags:
        return True, f"the CPU has {' and '.join(name[f] for f in flags)}"
    return False, f"the CPU has neither {' nor '.join(name[f] for f in NATIVE_FLAGS[precision])}"


def matmul_slowdown(dtype: torch.dtype, n: int = 256) -> float:
    """How many times slower an n x n matmul runs in `dtype` than in fp32 on this CPU (best of 3 each)."""
    import time

    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=generator), torch.randn(n, n, generator=generator)

    def best(x, y):
        x @ y
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            x @ y
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(a.to(dtype), b.to(dtype)) / max(best(a, b), 1e-9)


def cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def set_cpu_threads(requested: int | None, gflop_per_batch: float | None = None) -> tuple[int, str]:
    """Set this process's CPU threads (mixprec.threads.choose) and return (threads, why). `accelerate launch`
    sets OMP_NUM_THREADS=1 unless told `--cpu`; the recipe decides itself."""
    threads, why = choose(requested, gflop_per_batch)
    torch.set_num_threads(threads)
    return threads, why


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} x{torch.cuda.device_count()} per node"
    if device.type == "cpu":
        n = torch.get_num_threads()
        return f"{cpu_name()} ({n} thread{'s' if n != 1 else ''} per process)"
    return device.type


def machine_line() -> str:
    """The hardware a benchmark ran on, for its report: the GPU, or the CPU and its cores; torch and Python."""
    if torch.cuda.is_available():
        where = f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    else:
        where = f"{cpu_name()}, {usable_cores()} cores, no GPU"
    return f"{where}, torch {torch.__version__}, Python {platform.python_version()}"
