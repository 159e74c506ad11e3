"""Throughput and memory: what a step costs."""
from __future__ import annotations

import resource
import sys
import time

import torch


class Throughput:
    """Samples per second over a window of optimizer steps; `pause()` excludes evaluation and saving."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.start, self.samples = time.perf_counter(), 0

    def add(self, samples: int):
        self.samples += samples

    def rate(self) -> float:
        elapsed = time.perf_counter() - self.start
        return self.samples / elapsed if elapsed > 0 else 0.0


def peak_memory(device: torch.device) -> dict:
    """CUDA: max allocated and reserved by this process. CPU: peak resident set size of this process."""
    if device.type == "cuda":
        return {"peak_memory_bytes": torch.cuda.max_memory_allocated(device),
                "peak_memory_reserved_bytes": torch.cuda.max_memory_reserved(device),
                "peak_memory_kind": "cuda max allocated"}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return {"peak_memory_bytes": rss, "peak_memory_kind": "cpu peak resident set"}
