"""Precision: choose it, make it real, and say what it is.

- `resolve` turns the requested precision (auto, no, fp16, bf16) into the effective one for this
  hardware, with the reason; a mode that cannot run is a UsageError, never a quiet fallback.
- `build_accelerator` creates the `Accelerator`. Accelerate 1.15 quietly trains in fp32 when fp16 is
  requested on a CPU (no autocast, no GradScaler); here fp16 on a CPU is real: fp16 autocast and a
  CPU GradScaler (for testing the fp16 path without a GPU: CPUs seldom run fp16 faster than fp32).
- `fp32_eval` switches off the autocast that `accelerator.prepare` wraps around `model.forward`.
- `describe` / `banner`: device, world size and backend, requested and effective precision, autocast
  dtype, GradScaler settings and the dtype of the master weights (DeepSpeed and FSDP: see `distributed`).
- fp8 runs only where it can: a GPU with fp8 tensor cores (compute capability 8.9+) and TransformerEngine
  or torchao; anywhere else `--mixed_precision fp8` is a UsageError.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import asdict, dataclass, field

import torch
import accelerate.optimizer
import accelerate.utils.other
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import GradScalerKwargs

from . import distributed
from .errors import UsageError
from .hardware import cpu_flags, device_name, device_type, set_cpu_threads

AUTOCAST_DTYPE = {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}
FP8_PACKAGES = {"AO": "torchao", "TE": "transformer-engine"}


@dataclass
class Precision:
    requested: str
    effective: str  # no | fp16 | bf16
    reason: str
    device_type: str
    emulated: bool = False  # fp16 on a CPU: real fp16 autocast and loss scaling, which Accelerate skips
    scaler: dict = field(default_factory=dict)  # GradScaler settings when one is used
    engine: str = "torch"  # deepspeed: DeepSpeed holds the precision (16-bit weights, its own loss scaler)

    @property
    def autocast_dtype(self):
        return AUTOCAST_DTYPE[self.effective]


def native_bf16(dev: str) -> tuple[bool, str]:
    """Does this device run bf16 matmuls natively? Returns (answer, why)."""
    if dev == "cuda":
        major, minor = torch.cuda.get_device_capability()
        name = torch.cuda.get_device_name()
        if major >= 8:
            return True, f"{name} (compute capability {major}.{minor}) has bf16 tensor cores"
        return False, f"{name} (compute capability {major}.{minor}) has no bf16 support (needs 8.0+, Ampere or newer)"
    if dev == "cpu":
        flags = cpu_flags() & {"avx512_bf16", "amx_bf16"}
        if flags:
            return True, f"the CPU has {' and '.join(f.upper() for f in sorted(flags))}"
        return False, "the CPU has neither AVX512-BF16 nor AMX-BF16"
    return False, f"bf16 support on {dev} is not detected by this recipe"


def resolve(requested: str, dev: str, launcher: str | None = None) -> tuple[str, str]:
    """Effective precision and why. `launcher` is what `accelerate launch` was told (env)."""
    if launcher and launcher not in ("no", requested):
        if requested == "auto":
            requested = launcher
            origin = "from the accelerate config / launch flag"
        else:
            raise UsageError(
                f"--mixed_precision {requested} disagrees with the launcher's mixed_precision={launcher}: "
                f"make them the same, or drop one of them")
    else:
        origin = ""
    bf16_ok, why = native_bf16(dev)
    if requested == "auto":
        if bf16_ok:
            return "bf16", f"auto: {why}"
        if dev == "cuda":
            return "fp16", f"auto: {why}; fp16 with loss scaling instead"
        return "no", f"auto: {why}; no fp16 on {dev} by default, so fp32"
    if requested == "fp8":
        return "fp8", f"requested: {fp8_support(dev)} {origin}".strip()
    if requested == "bf16" and dev == "cuda" and not bf16_ok:
        raise UsageError(f"--mixed_precision bf16 is not supported here: {why}; use --mixed_precision fp16")
    if requested == "fp16" and dev == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--mixed_precision fp16 needs a working MPS device: use --mixed_precision no")
    note = {
        "no": "requested: fp32",
        "fp16": "requested" + ("; fp16 on a CPU is for testing the fp16 path, not for speed" if dev == "cpu" else ""),
        "bf16": "requested" + ("" if bf16_ok or dev != "cpu" else f"; {why}: bf16 runs, but emulated and slower"),
    }[requested]
    return requested, f"{note} {origin}".strip()


def fp8_support(dev: str) -> str:
    """Why fp8 can run here; a UsageError where it cannot (no fp8 tensor cores, or no fp8 backend)."""
    if dev != "cuda":
        raise UsageError(f"--mixed_precision fp8 needs an NVIDIA GPU with fp8 tensor cores (Ada or Hopper, compute "
                         f"capability 8.9+) and TransformerEngine or torchao; this machine has no CUDA GPU: use bf16")
    (major, minor), name = torch.cuda.get_device_capability(), torch.cuda.get_device_name()
    if (major, minor) < (8, 9):
        raise UsageError(f"--mixed_precision fp8: {name} (compute capability {major}.{minor}) has no fp8 tensor "
                         f"cores (needs 8.9+, Ada or Hopper): use bf16")
    from accelerate.utils import is_torchao_available, is_transformer_engine_available

    installed = {"AO": is_torchao_available(), "TE": is_transformer_engine_available()}
    backend = os.environ.get("ACCELERATE_FP8_BACKEND", "").upper()
    if backend in installed and not installed[backend]:
        raise UsageError(f"the accelerate config's fp8 backend {backend} needs {FP8_PACKAGES[backend]}, which is not "
                         f"installed: pip install {FP8_PACKAGES[backend]}, or change fp8_config.backend")
    if backend not in installed:
        backend = next((b for b, ok in installed.items() if ok), None)  # Accelerate's own order: torchao first
        if backend is None:
            raise UsageError("--mixed_precision fp8 needs TransformerEngine or torchao: pip install torchao")
    return f"{name} (compute capability {major}.{minor}) has fp8 tensor cores; backend {FP8_PACKAGES[backend]}"


def _ask_once_for_lomo() -> None:
    """Accelerate 1.15's optimizer step asks importlib twice per step whether `lomo_optim` is installed: about
    0.3 ms a step, 13% of the MLP's 2 ms step on a 2-core CPU (recipes/benchmark.py, mlp config). The answer
    cannot change while training, so it is asked once."""
    import accelerate.optimizer as accelerated

    if not hasattr(accelerated.is_lomo_available, "cache_info"):
        accelerated.is_lomo_available = functools.cache(accelerated.is_lomo_available)


_DEEPSPEED_INSTALLED = accelerate.utils.other.is_deepspeed_available


def _skip_accelerate_overheads(deepspeed: bool) -> None:
    """Two costs of Accelerate 1.15 that do nothing for these recipes (measured on the 2-core CPU VM):

    - its optimizer step asks importlib twice per step whether `lomo_optim` is installed: about 0.1 ms a
      step, 3-4% of the MLP's (recipes/benchmark.py); the answer cannot change while training, so it is
      asked once;
    - its `unwrap_model` (evaluation, the final save) imports DeepSpeed whenever it is installed, to test for
      a DeepSpeed engine: 1.7 s and a DeepSpeed warning line in the middle of a plain run. Only a DeepSpeed
      launch can hold that engine.
    """
    if not hasattr(accelerate.optimizer.is_lomo_available, "cache_info"):
        accelerate.optimizer.is_lomo_available = functools.cache(accelerate.optimizer.is_lomo_available)
    accelerate.utils.other.is_deepspeed_available = _DEEPSPEED_INSTALLED if deepspeed else (lambda: False)


def build_accelerator(cfg, **accelerator_kwargs) -> tuple[Accelerator, Precision]:
    """Create the Accelerator for `cfg` with the precision made real. Extra kwargs go to Accelerator."""
    dev = device_type()
    if dev == "cpu":
        set_cpu_threads(cfg.cpu_threads)
    _ask_once_for_lomo()
    launch = distributed.Launch.from_env(dev)  # refuses launches that would train alone or not shard
    _skip_accelerate_overheads(launch.deepspeed)
    launcher = launch.precision_requirement(cfg.mixed_precision, os.environ.get("ACCELERATE_MIXED_PRECISION"))
    effective, reason = resolve(cfg.mixed_precision, dev, launcher)
    scaler = {"init_scale": cfg.init_scale, "growth_interval": cfg.growth_interval,
              "growth_factor": 2.0, "backoff_factor": 0.5} if effective == "fp16" else {}
    dist = launch.accelerator_kwargs(cfg, effective)  # cpu=..., and the DeepSpeed plugin derived from cfg
    handlers = [GradScalerKwargs(**scaler)] if scaler and not launch.deepspeed else []
    handlers += dist.pop("kwargs_handlers") + accelerator_kwargs.pop("kwargs_handlers", [])
    accelerator = Accelerator(
        mixed_precision=effective,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        kwargs_handlers=handlers,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        **dist,
        **accelerator_kwargs,
    )
    launch.check_world(accelerator)
    prec = Precision(cfg.mixed_precision, effective, reason, accelerator.device.type, scaler=scaler)
    if launch.deepspeed:
        prec.engine = "deepspeed"
    elif effective == "fp16" and accelerator.device.type == "cpu" and accelerator.scaler is None:
        # Accelerate 1.15 would train in fp32 here without a word. Make fp16 real instead.
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu", **scaler)
        prec.emulated = True
    check_effective(accelerator, prec)
    return accelerator, prec


def check_effective(accelerator: Accelerator, prec: Precision) -> None:
    """Refuse to train if Accelerate ended up somewhere else than the precision we resolved."""
    if prec.engine == "deepspeed":  # no autocast, no GradScaler: DeepSpeed's config holds the precision
        if accelerator.mixed_precision != prec.effective or accelerator.scaler is not None:
            raise RuntimeError(f"precision mismatch: resolved {prec.effective}, DeepSpeed has {accelerator.mixed_precision}")
        return
    wants_amp = prec.effective in ("fp16", "bf16", "fp8")
    if accelerator.mixed_precision != prec.effective or accelerator.native_amp != wants_amp:
        raise RuntimeError(f"precision mismatch: resolved {prec.effective}, Accelerate has "
                           f"mixed_precision={accelerator.mixed_precision} native_amp={accelerator.native_amp}")
    if (prec.effective == "fp16") != (accelerator.scaler is not None):
        raise RuntimeError(f"precision mismatch: {prec.effective} but GradScaler is {accelerator.scaler}")


@contextlib.contextmanager
def fp32_eval(model, accelerator: Accelerator, enabled: bool = True):
    """Run `model` without autocast inside this block.

    `accelerator.prepare` replaces the instance's `forward` with an autocast-wrapped one, and an
    outer `torch.autocast(enabled=False)` cannot switch off the autocast entered inside it. So the
    wrapped `forward` is taken off the instance for the block (the class's own `forward` is used),
    and put back afterwards.
    """
    if not enabled:
        yield
        return
    raw = accelerator.unwrap_model(model)
    patched = raw.__dict__.pop("forward", None)
    try:
        with torch.autocast(device_type=accelerator.device.type, enabled=False):
            yield
    finally:
        if patched is not None:
            raw.forward = patched


def describe(accelerator: Accelerator, prec: Precision, model=None, eval_precision: str = "fp32") -> dict:
    """The effective precision and hardware, as written to the banner and config.yaml."""
    dev = accelerator.device
    name = device_name(dev)
    state = accelerator.state
    backend = getattr(state, "backend", None) if accelerator.num_processes > 1 else None
    info = {
        "device": str(dev),
        "device_name": name,
        "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "world_size": accelerator.num_processes,
        "backend": backend or "none (one process)",
        "requested_precision": prec.requested,
        "effective_precision": prec.effective,
        "precision_reason": prec.reason,
        "autocast_dtype": str(prec.autocast_dtype).replace("torch.", "") if prec.autocast_dtype else "none",
        "fp16_emulated_on_cpu": prec.emulated,
        "grad_scaler": dict(prec.scaler) if accelerator.scaler is not None else "off",
        "eval_precision": "fp32" if eval_precision == "fp32" else f"same ({prec.effective})",
        "torch": str(torch.__version__),
    }
    if prec.effective == "fp8":
        info["autocast_dtype"] = f"bfloat16, fp8 matmuls in the converted Linear layers ({accelerator.fp8_backend.value})"
    if model is not None:
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
        info["master_weight_dtype"] = ",".join(dtypes)
        info.update(distributed.describe(accelerator, model, prec.effective))
    return info


def banner(info: dict, extra: list[str] = ()) -> str:
    """The facts of `info`, then `extra` lines (e.g. peak FLOP/s, speed options), between two rules."""
    scaler = info["grad_scaler"]
    scaler_text = scaler if isinstance(scaler, str) else "on (" + ", ".join(f"{k}={v:g}" for k, v in scaler.items()) + ")"
    lines = [
        f"device         {info['device']}: {info['device_name']}",
        f"processes      {info['world_size']} ({info['distributed_type']}, backend {info['backend']})"
        + (f", {info['engine']}" if "engine" in info else ""),
        f"precision      requested {info['requested_precision']} -> effective {info['effective_precision']}"
        f" ({info['precision_reason']})",
        f"autocast       {info['autocast_dtype']}" + ("  [fp16 on CPU: an emulation for testing, not for speed]" if info["fp16_emulated_on_cpu"] else ""),
        f"GradScaler     {scaler_text}",
        f"master weights {info.get('master_weight_dtype', '?')}"
        + (f" ({info['master_weight_note']}); model weights {info['model_weight_dtype']}" if "model_weight_dtype" in info else ""),
        f"evaluation     {info['eval_precision']}",
        *extra,
    ]
    if "deepspeed" in info:  # the batch DeepSpeed checks: micro x accumulation x world size
        ds = info["deepspeed"]
        lines.append(f"deepspeed      train_batch_size {ds['train_batch_size']} = micro {ds['train_micro_batch_size_per_gpu']}"
                     f" x accumulation {ds['gradient_accumulation_steps']} x {info['world_size']} processes, "
                     f"gradient_clipping {ds['gradient_clipping']:g}")
    width = max(len(s) for s in lines)
    return "\n".join(["=" * width, *lines, "=" * width])


def as_dict(prec: Precision) -> dict:
    return asdict(prec)
