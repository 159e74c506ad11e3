"""What the recipe runs on: device type, CPU features and name, threads per process; a launch that names GPUs
torch cannot see is refused (`refuse_missing_gpus`) instead of training on the CPU for hours."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from ..errors import UsageError
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


def set_cpu_threads(requested: int | None, gflop_per_batch: float | None = None,
                    recorded: int | None = None) -> tuple[int, str]:
    """Set this process's CPU threads (mixprec.devices.threads.choose) and return (threads, why). `accelerate launch`
    sets OMP_NUM_THREADS=1 unless told `--cpu`; the recipe decides itself."""
    threads, why = choose(requested, gflop_per_batch, recorded)
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


def _launcher_argv() -> list[str] | None:
    """The options of the `accelerate launch` that started this process (its parent: the simple launcher and
    torch's elastic agent both start the script as a child), up to the training script; None when the parent
    is something else or cannot be read (not Linux)."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    for i, arg in enumerate(argv):
        start = i + 1 if arg == "accelerate.commands.launch" else (
            i + 2 if Path(arg).name == "accelerate" and argv[i + 1:i + 2] == ["launch"] else None)
        if start is not None:
            rest = argv[start:]
            script = next((j for j, a in enumerate(rest) if a.endswith(".py")), len(rest))
            return rest[:script]
    return None


def _option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def requested_gpus(argv: list[str] | None) -> tuple[str, str] | None:
    """(GPU ids, where they are named) when the launch names GPUs: `--gpu_ids 0,1` or a config's `gpu_ids: '0'`
    (accelerate_configs/single_gpu.yaml), without `--cpu` or `use_cpu: true`. `gpu_ids: all`, '-1,-1'
    (multi_cpu.yaml) and configs without gpu_ids (DeepSpeed's, multi_node.yaml) run on CPUs too: not a request."""
    if argv is None or "--cpu" in argv:
        return None
    import yaml

    path = _option(argv, "--config_file")
    if path is None:
        from accelerate.commands.config import default_config_file as path
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError):
        config = {}
    config = config if isinstance(config, dict) else {}
    flag = _option(argv, "--gpu_ids")
    ids = flag if flag is not None else config.get("gpu_ids")
    if config.get("use_cpu") is True or ids is None or not all(x.strip().isdigit() for x in str(ids).split(",")):
        return None
    return str(ids), ("--gpu_ids" if flag is not None else f"gpu_ids in {path}")


def refuse_missing_gpus() -> None:
    """A launch that names GPUs on a machine where torch sees none stops here, before anything is written, with
    the likely cause: a CPU-only torch build, CUDA_VISIBLE_DEVICES hiding the GPUs, or the driver."""
    if torch.cuda.is_available() or not any(k.startswith("ACCELERATE_") for k in os.environ):
        return
    asked = requested_gpus(_launcher_argv())
    if asked is None:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.version.cuda is None:
        cause = (f"this torch ({torch.__version__}) is a CPU-only build (torch.version.cuda is None): install a "
                 f"CUDA build of torch (pytorch.org/get-started/locally)")
    elif visible is not None and not all(x.strip().isdigit() for x in visible.split(",")):
        cause = f"CUDA_VISIBLE_DEVICES={visible!r} hides the GPUs: unset it or name GPUs that exist (nvidia-smi -L)"
    else:
        cause = (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no GPU"
                 f"{f' among CUDA_VISIBLE_DEVICES={visible}' if visible else ''}: check the NVIDIA driver "
                 f"(nvidia-smi; it must support CUDA {torch.version.cuda})")
    raise UsageError(f"the launch asks for GPU {asked[0]} ({asked[1]}) but torch sees no GPU: {cause}; to train on "
                     f"the CPU on purpose, launch with accelerate_configs/cpu.yaml")
