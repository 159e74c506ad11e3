"""What a step costs: throughput, time waiting for data, memory, and model FLOPs utilisation (MFU).

- `training_cost`: FLOPs per sample of one training step (forward and backward). GPT models: the PaLM /
  nanoGPT formula per token, 6N + 12 * L * H * Q * T, times the tokens of a sample. Other models: their
  Linear and Conv layers, from one forward pass (`count_flops`).
- `peak_flops`: the device's peak FLOP/s in the training precision, from `PEAK_TFLOPS` (NVIDIA datasheets,
  dense, no sparsity) or, for a CPU or an unlisted GPU, measured at start-up with a one-second matmul
  benchmark in the training dtype; `--peak_flops` overrides both.
- `Throughput`: samples/s, tokens/s, step time, share of time spent waiting for the next batch, MFU, and the
  peak memory, per logging window (the maximum over processes, the peak reset after each window) and over
  the whole run (evaluation and checkpoint time left out).
- `peak_memory`: CUDA max allocated and max reserved; on a CPU the peak resident set (Linux: VmHWM, which
  the recipe resets after each window through /proc/self/clear_refs).
"""
from __future__ import annotations

import copy
import math
import re
import resource
import sys
import time

import torch

# fields of metrics.jsonl that measure time or memory: they differ between any two runs
TIMING_FIELDS = ("samples_per_s", "tokens_per_s", "step_time_s", "data_wait_frac", "mfu", "peak_memory_bytes",
                 "peak_memory_reserved_bytes", "timeline", "wall_time_s")

# Dense peak TFLOP/s by GPU (name pattern, first match wins) and precision. Sources: NVIDIA datasheets
# (H100/H200: nvidia.com/en-us/data-center/h100 and /h200; A100: A100 datasheet; L4, L40S, A10, V100, T4:
# their product pages). Datasheets quote tensor-core numbers with 2:4 sparsity for Ampere and later: halved.
PEAK_TFLOPS: list[tuple[str, str, dict[str, float]]] = [
    (r"H100.*PCIe", "H100 PCIe", {"fp8": 1513, "bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51}),
    (r"H100 NVL", "H100 NVL", {"fp8": 1671, "bf16": 835, "fp16": 835, "tf32": 418, "fp32": 60}),
    (r"H200 NVL", "H200 NVL", {"fp8": 1671, "bf16": 835, "fp16": 835, "tf32": 418, "fp32": 60}),
    (r"H100|H200|GH200", "H100/H200 SXM", {"fp8": 1979, "bf16": 989, "fp16": 989, "tf32": 495, "fp32": 67}),
    (r"A100", "A100", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    (r"L40S", "L40S", {"fp8": 733, "bf16": 362, "fp16": 362, "tf32": 183, "fp32": 91.6}),
    (r"\bL4\b", "L4", {"fp8": 242, "bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3}),
    (r"\bA10\b", "A10", {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2}),
    (r"V100.*PCIE", "V100 PCIe", {"fp16": 112, "fp32": 14}),
    (r"V100", "V100 SXM2", {"fp16": 125, "fp32": 15.7}),
    (r"\bT4\b", "T4", {"fp16": 65, "fp32": 8.1}),
]
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def training_cost(model: torch.nn.Module, example: torch.Tensor, info: dict) -> dict:
    """FLOPs of one training step per sample, and tokens per sample (1 for non-text)."""
    tokens = int(example.shape[-1]) if info.get("task") == "language_modeling" else 1
    if hasattr(model, "flops_per_token"):
        return {"flops_per_sample": float(model.flops_per_token(tokens) * tokens), "tokens_per_sample": tokens,
                "flops_method": "6N + 12*L*H*Q*T per token (PaLM / nanoGPT)"}
    return {"flops_per_sample": count_flops(model, example), "tokens_per_sample": tokens,
            "flops_method": "counted (Linear and Conv layers), forward + backward"}


def count_flops(model: torch.nn.Module, example: torch.Tensor) -> float:
    """Forward + backward FLOPs per sample of the model's Linear and Conv layers (2 per multiply-add), from
    one forward pass of a copy of the model (its weights and statistics untouched). Backward costs twice the
    forward (input and weight gradients), less the input gradient a layer fed by the data does not need: what
    torch's FlopCounterMode counts, without loading torch._dynamo (about 2 s of every run's start)."""
    twin = copy.deepcopy(model).train()
    batch = example.unsqueeze(0).expand(2, *example.shape).clone()  # two samples: batch norm needs more than one
    total = [0]

    def hook(module, inputs, output):
        if isinstance(module, torch.nn.Linear):
            forward = 2 * output.numel() * module.in_features
        else:  # convolutions: each output element takes (in channels / groups) x kernel multiply-adds
            forward = 2 * output.numel() * math.prod(module.weight.shape[1:])
        total[0] += forward * (2 + inputs[0].requires_grad)

    layers = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    hooks = [m.register_forward_hook(hook) for m in twin.modules() if isinstance(m, layers)]
    try:
        with torch.enable_grad():
            twin(batch)
    finally:
        for h in hooks:
            h.remove()
    return total[0] / 2


def table_peak(device_name: str, key: str) -> tuple[float, str] | None:
    for pattern, label, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return (peaks[key] * 1e12, f"{label} datasheet, dense {key}") if key in peaks else None
    return None


def measure_peak(device: torch.device, dtype: torch.dtype, seconds: float | None = None) -> float:
    """FLOP/s of the best of repeated n x n matmuls in `dtype` during about `seconds` (n = 1024 on a CPU,
    for 0.1 s: 0.25 s was as good as 1 s on the 2-core VM, within 3%, and 0.1 s as good as 0.25 s, within 1%:
    medians of 6 interleaved probes on 1 thread of the Intel Xeon with AMX, on a busy machine, fp32 0.195 against
    0.191 TFLOP/s, bf16 1.432 against 1.445; n = 4096 on a GPU, for 1 s while its clocks rise); the first one
    warms up and is not counted."""
    gpu = device.type == "cuda"
    n, seconds = (4096, seconds or 1.0) if gpu else (1024, seconds or 0.1)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    best, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        a @ b
        sync()
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def peak_flops(device: torch.device, effective_precision: str, tf32: bool = False,
               override: float | None = None) -> dict:
    """{'peak_flops': FLOP/s per device or None, 'peak_flops_source': where it came from}. Never raises."""
    key = {"no": "tf32" if tf32 else "fp32"}.get(effective_precision, effective_precision)
    if override:
        return {"peak_flops": float(override), "peak_flops_source": "--peak_flops"}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    found = table_peak(name, key) if name else None
    if found:
        return {"peak_flops": found[0], "peak_flops_source": found[1]}
    what = f"{name} is not in the table" if name else f"{device.type}: no table"
    if device.type == "cpu" and key in ("bf16", "fp16"):
        from .devices.hardware import cpu_native

        native, why = cpu_native(key)
        if not native:
            return {"peak_flops": None, "peak_flops_source": f"none: {key} is emulated on this CPU ({why})"}
    try:
        value = measure_peak(device, DTYPES.get(key, torch.float32))
        return {"peak_flops": value, "peak_flops_source": f"measured at start-up ({what}): best {key} matmul"}
    except Exception as err:  # noqa: BLE001  an unknown device must never stop the run
        return {"peak_flops": None, "peak_flops_source": f"unknown ({what}; the benchmark failed: {err})"}


def describe_peak(cost: dict, peak: dict) -> str:
    value = f"{peak['peak_flops'] / 1e12:.3g} TFLOP/s" if peak["peak_flops"] else "unknown: MFU not reported"
    return (f"peak FLOP/s    {value} ({peak['peak_flops_source']}); "
            f"{cost['flops_per_sample'] / 1e9:.4g} GFLOP per sample ({cost['flops_method']})")


class Throughput:
    """Rates over the time spent training. `timed(batches)` measures the wait for each batch, `add` counts a
    micro-batch, `exclude_pause` (after evaluation or saving) leaves the time since the last batch out."""

    def __init__(self, cost: dict | None = None, peak: dict | None = None, world_size: int = 1, device=None,
                 reduce_max=None):
        cost, peak = cost or {}, peak or {}
        self.reduce_max = reduce_max or (lambda value: value)  # the maximum over processes
        self.peak_memory = 0
        self.flops_per_sample = cost.get("flops_per_sample")
        self.tokens_per_sample = cost.get("tokens_per_sample", 1)
        self.text = cost.get("tokens_per_sample", 1) > 1
        self.peak = peak.get("peak_flops")
        self.world_size, self.device = world_size, device or torch.device("cpu")
        self.last = time.perf_counter()
        self.total = self._zero()
        self.window = self._zero()

    @staticmethod
    def _zero() -> dict:
        return {"samples": 0, "steps": 0, "time": 0.0, "wait": 0.0}

    def _tick(self) -> None:
        now = time.perf_counter()
        for acc in (self.window, self.total):
            acc["time"] += now - self.last
        self.last = now

    def timed(self, batches):
        iterator = iter(batches)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            waited = time.perf_counter() - t0
            for acc in (self.window, self.total):
                acc["wait"] += waited
            yield batch

    def add(self, samples: int, step: bool = True) -> None:
        """A micro-batch of `samples` (all processes) is done; `step`: it ended an optimizer step."""
        self._tick()
        for acc in (self.window, self.total):
            acc["samples"] += samples
            acc["steps"] += int(step)

    def exclude_pause(self) -> None:
        """Evaluation or saving happened since the last batch: do not count that time."""
        self.last = time.perf_counter()

    def rates(self, acc: dict) -> dict:
        elapsed = acc["time"]
        if elapsed <= 0 or acc["samples"] == 0:
            return {}
        samples_per_s = acc["samples"] / elapsed
        out = {"samples_per_s": samples_per_s}
        if self.text:
            out["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        out["step_time_s"] = elapsed / max(1, acc["steps"])
        out["data_wait_frac"] = min(1.0, acc["wait"] / elapsed)
        if self.flops_per_sample and self.peak:
            out["mfu"] = samples_per_s * self.flops_per_sample / (self.peak * self.world_size)
        return out

    def report(self) -> dict:
        """Rates and peak memory since the last report (after syncing the device), then a new window starts."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._tick()
        out, self.window = self.rates(self.window), self._zero()
        memory = peak_memory(self.device, kind=False)
        memory = {k: int(self.reduce_max(v)) for k, v in memory.items()}
        self.peak_memory = max(self.peak_memory, memory["peak_memory_bytes"])
        reset_peak_memory(self.device)
        return {**out, **memory}

    def summary(self) -> dict:
        kind = peak_memory(self.device)["peak_memory_kind"]
        return {**self.rates(self.total), "peak_memory_bytes": self.peak_memory, "peak_memory_kind": kind}


def _vm_hwm() -> int | None:
    """This process's peak resident set since the last reset (Linux), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "cpu":
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident set
        except OSError:
            pass


def peak_memory(device: torch.device, kind: bool = True) -> dict:
    """CUDA: max allocated and reserved by this process. CPU: peak resident set size of this process."""
    if device.type == "cuda":
        out = {"peak_memory_bytes": torch.cuda.max_memory_allocated(device),
               "peak_memory_reserved_bytes": torch.cuda.max_memory_reserved(device)}
        return {**out, "peak_memory_kind": "cuda max allocated"} if kind else out
    rss = _vm_hwm()
    if rss is None:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    out = {"peak_memory_bytes": rss}
    return {**out, "peak_memory_kind": "cpu peak resident set"} if kind else out


def describe_summary(summary: dict) -> str:
    """One line: the whole run's speed and memory, as in summary.json."""
    parts = [f"{summary[k]:,.0f} {label}" for k, label in (("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s"))
             if summary.get(k)]
    if summary.get("step_time_s"):
        parts.append(f"{summary['step_time_s'] * 1e3:.1f} ms/step")
    if "data_wait_frac" in summary:
        parts.append(f"{summary['data_wait_frac']:.1%} waiting for data")
    if summary.get("mfu"):
        parts.append(f"MFU {summary['mfu']:.1%}")
    parts.append(f"peak memory {summary['peak_memory_bytes'] / 2**30:.2f} GiB ({summary['peak_memory_kind']})")
    return "speed: " + ", ".join(parts)
