"""Precision: choose it, make it real, and say what it is.

- `resolve` turns the requested precision (auto, no, fp16, bf16) into the effective one for this
  hardware, with the reason; a mode that cannot run is a UsageError, never a quiet fallback.
- `choose` resolves it for this hardware and launch, with the Accelerator's arguments; recipes/train.py builds
  the `Accelerator` and `make_real` checks it (`build_accelerator`: the three in one call). fp16 on a CPU is real (fp16 autocast and a CPU GradScaler;
  Accelerate alone would quietly train in fp32: `compat.fp16_on_cpu`), for testing the fp16 path without a
  GPU: CPUs without fp16 arithmetic run it far slower than fp32 (the banner says how much slower).
- `describe` / `banner`: device, world size and backend, requested and effective precision, autocast
  dtype, GradScaler settings and the dtype of the master weights (DeepSpeed and FSDP: see `distributed`).
- fp8 runs only where it can: a GPU with fp8 tensor cores (compute capability 8.9+) and TransformerEngine
  or torchao; anywhere else `--mixed_precision fp8` is a UsageError.
- `policy` (mixprec.precision.policy): per-module precision, `--fp32_modules`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from accelerate.utils import GradScalerKwargs

from .. import compat
from ..devices import distributed
from ..errors import UsageError
from ..devices.hardware import (cpu_native, device_name, device_type, matmul_slowdown, refuse_missing_gpus, set_cpu_threads)
from . import policy

AUTOCAST_DTYPE = {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}
FP8_PACKAGES = {"AO": "torchao", "TE": "transformer-engine"}


@dataclass
class Precision:
    requested: str
    effective: str  # no | fp16 | bf16
    reason: str
    device_type: str
    made_real: bool = False  # fp16 on a CPU: fp16 autocast and loss scaling that Accelerate would skip
    scaler: dict = field(default_factory=dict)  # GradScaler settings when one is used
    engine: str = "torch"  # deepspeed: DeepSpeed holds the precision (16-bit weights, its own loss scaler)
    fp32_modules: dict = field(default_factory=dict)  # --fp32_modules: pattern -> modules kept in fp32
    fp32_plan: dict | None = None  # --fp32_modules auto: the plan (mixprec.precision.auto_fp32)
    kwargs_handlers: list = field(default_factory=list, repr=False)  # for Accelerator(...): the GradScaler's, fp8's
    launch_kwargs: dict = field(default_factory=dict, repr=False)  # for Accelerator(...): cpu=, deepspeed_plugin=
    launch: object = field(default=None, repr=False)  # mixprec.devices.distributed.Launch: what the launcher asked for

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
        return cpu_native("bf16")
    return False, f"bf16 support on {dev} is not detected by this recipe"


def resolve(requested: str, dev: str, launcher: str | None = None) -> tuple[str, str]:
    """Effective precision and why. `launcher` is what `accelerate launch` was told (env). Its 'no' is
    Accelerate's default when nothing was given, and the launcher warns "`--mixed_precision` was set to a value of
    'no'" then: ignored here, and the reason says so where the run is not fp32, so the console does not seem to
    contradict the banner."""
    effective, reason = _resolve(requested, dev, launcher)
    if launcher == "no" and effective != "no":
        reason += "; the launcher's mixed_precision 'no' is its default, ignored"
    return effective, reason


def _resolve(requested: str, dev: str, launcher: str | None) -> tuple[str, str]:
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
    note = {"no": "requested: fp32", "fp16": "requested", "bf16": "requested"}[requested]
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


def choose(cfg) -> Precision:
    """The precision this hardware and launch run for --mixed_precision (auto: bf16 where it is native), with the
    Accelerator's arguments for it (`kwargs_handlers`, `launch_kwargs`); a mode that cannot run is a UsageError.
    Nothing is built yet: recipes/train.py makes the `Accelerator`, then `make_real`."""
    refuse_missing_gpus()  # GPUs named by the launch, none seen: one line, not a CPU run of hours
    dev = device_type()
    if dev == "cpu":
        set_cpu_threads(cfg.cpu_threads)
        # the device is known: DeepSpeed (which Accelerate's unwrap_model imports where it is installed) would
        # guess it and print "Setting accelerator to CPU. If you have GPU ..., we were unable to detect it"
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    launch = distributed.Launch.from_env(dev)  # refuses launches that would train alone or not shard
    launcher = launch.precision_requirement(cfg.mixed_precision, os.environ.get("ACCELERATE_MIXED_PRECISION"))
    effective, reason = resolve(cfg.mixed_precision, dev, launcher)
    scaler = {"init_scale": cfg.init_scale, "growth_interval": cfg.growth_interval,
              "growth_factor": 2.0, "backoff_factor": 0.5} if effective == "fp16" else {}
    # cpu=..., and the DeepSpeed plugin derived from the batch, clipping and loss-scale settings
    dist = launch.accelerator_kwargs(cfg.optim, cfg.precision, effective)
    handlers = [GradScalerKwargs(**scaler)] if scaler and not launch.deepspeed else []
    handlers += dist.pop("kwargs_handlers")
    handlers += policy.fp8_kwargs_handlers(cfg.precision, effective)  # fp8 with --fp32_modules: those stay out of fp8
    return Precision(cfg.mixed_precision, effective, reason, dev, scaler=scaler,
                     engine="deepspeed" if launch.deepspeed else "torch", kwargs_handlers=handlers,
                     launch_kwargs=dist, launch=launch)


def make_real(accelerator: Accelerator, prec: Precision) -> None:
    """After `Accelerator(...)`: the launch is one process group (DeepSpeed engaged where asked), fp16 on a CPU is
    real (fp16 autocast and torch's CPU GradScaler: Accelerate alone would quietly train in fp32,
    `compat.fp16_on_cpu`), and Accelerate runs the precision `choose` resolved (else a RuntimeError)."""
    prec.launch.check_world(accelerator)
    prec.device_type = accelerator.device.type
    if prec.engine != "deepspeed":
        prec.made_real = compat.fp16_on_cpu(accelerator, prec.scaler)
    check_effective(accelerator, prec)


def build_accelerator(cfg, **accelerator_kwargs) -> tuple[Accelerator, Precision]:
    """`choose`, `Accelerator(...)` and `make_real` in one call, as recipes/train.py does them (for the tools and
    tests that need an Accelerator without the recipe). Extra kwargs go to Accelerator."""
    prec = choose(cfg)
    accelerator = Accelerator(
        mixed_precision=prec.effective, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        step_scheduler_with_optimizer=False,
        kwargs_handlers=prec.kwargs_handlers + accelerator_kwargs.pop("kwargs_handlers", []),
        **prec.launch_kwargs, **accelerator_kwargs)
    make_real(accelerator, prec)
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


def describe(accelerator: Accelerator, prec: Precision, model=None, eval_precision: str = "fp32",
             optimizer=None) -> dict:
    """The effective precision and hardware, as written to the banner and config.yaml (`optimizer`: the prepared
    one, whose master weights DeepSpeed keeps)."""
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
        "grad_scaler": dict(prec.scaler) if accelerator.scaler is not None else "off",
        "eval_precision": "fp32" if eval_precision == "fp32" else f"same ({prec.effective})",
        "torch": str(torch.__version__),
    }
    if prec.effective == "fp8":
        info["autocast_dtype"] = f"bfloat16, fp8 matmuls in the converted Linear layers ({accelerator.fp8_backend.value})"
    if dev.type == "cpu" and prec.effective in ("bf16", "fp16"):
        info["cpu_half"] = cpu_half(prec.effective)
    if prec.made_real:
        info["grad_scaler_note"] = "torch's CPU GradScaler and fp16 autocast: Accelerate alone would train in fp32 here"
    if prec.fp32_modules:
        info["fp32_modules"] = {pattern: list(names) for pattern, names in prec.fp32_modules.items()}
    if prec.fp32_plan:
        info["fp32_plan"] = prec.fp32_plan
    if model is not None:
        trained = [p for p in model.parameters() if p.requires_grad] or list(model.parameters())  # LoRA: adapters
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in trained})
        info["master_weight_dtype"] = ",".join(dtypes)
        info.update(distributed.describe(accelerator, model, prec.effective, optimizer))
    return info


def cpu_half(precision: str) -> dict:
    """Whether this CPU runs bf16/fp16 natively, and if not, how much slower a matmul is than in fp32."""
    native, why = cpu_native(precision)
    out = {"native": native, "why": why}
    if not native:
        out["matmul_slowdown"] = round(matmul_slowdown(AUTOCAST_DTYPE[precision]), 1)
    return out


def _autocast_note(info: dict) -> str:
    half = info.get("cpu_half")
    if not half:
        return ""
    if half["native"]:
        return f"  [{info['effective_precision']} on a CPU: {half['why']}]"
    return (f"  [{info['effective_precision']} is emulated on this CPU ({half['why']}): a matmul runs "
            f"{half['matmul_slowdown']:g}x slower than fp32; for testing the {info['effective_precision']} path, "
            f"not for speed]")


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
        f"autocast       {info['autocast_dtype']}{_autocast_note(info)}",
        f"GradScaler     {scaler_text}" + (f" [{info['grad_scaler_note']}]" if "grad_scaler_note" in info else ""),
        f"master weights {info.get('master_weight_dtype', '?')}"
        + (f" ({info['master_weight_note']}); model weights {info['model_weight_dtype']}" if "model_weight_dtype" in info else ""),
        *([f"master update  {info['master_update']}"] if "master_update" in info and "model_weight_dtype" not in info
          else []),
        f"evaluation     {info['eval_precision']}",
        *filter(None, [policy.banner_line(info)]),
        *extra,
    ]
    if "deepspeed" in info:  # the batch DeepSpeed checks: micro x accumulation x world size
        ds = info["deepspeed"]
        lines.append(f"deepspeed      train_batch_size {ds['train_batch_size']} = micro {ds['train_micro_batch_size_per_gpu']}"
                     f" x accumulation {ds['gradient_accumulation_steps']} x {info['world_size']} processes, "
                     f"gradient_clipping {ds['gradient_clipping']:g}")
    width = max(len(s) for s in lines)
    return "\n".join(["=" * width, *lines, "=" * width])
