"""Per-module precision: `--fp32_modules PATTERNS` keeps the named modules in fp32 under fp16, bf16 and fp8.

PATTERNS are comma-separated globs (fnmatch, case-sensitive; `*` also crosses dots) over the names of
`model.named_modules()` of the model as built, before any wrapper: `net.2`, `h.*.ln_*`, `h.0.attn.c_attn`.
A pattern that matches no module is a UsageError that lists some real names (before the run folder is
touched). `auto` alone: the list is chosen by measurement on the run's first batches (mixprec.precision.auto_fp32;
a resume reuses the plan its checkpoint recorded). Each matched module's forward runs with autocast off and its floating inputs cast to fp32, so
its matmuls (and, through autograd, their backward) are fp32; the modules around it stay in the autocast
dtype.

Why the module's `forward` is replaced on the instance (by `Fp32Forward`): `accelerator.prepare` wraps only
the root's forward in autocast, and an autocast switched off inside a module overrides an enclosing one,
so the policy holds under `prepare`, DDP and `torch.compile` (which traces through it). A forward pre-hook
could cast the inputs but could not scope `autocast(enabled=False)` to the module's forward alone.
`Fp32Forward` reaches the module through an attribute, so `copy.deepcopy` of the model keeps the policy on
the copy. The root module itself is never matched: that would be fp32 training (--mixed_precision no).

Engines whose weights are 16-bit (DeepSpeed bf16/fp16 casts the weights themselves; FSDP's
MixedPrecision policy casts the parameters it gathers) cannot run one module in fp32: refused, one line.

fp8 (GPU only; prepared, not run here): with torchao (Accelerate's AO backend), the named modules' Linear
layers are kept out of fp8 conversion through `AORecipeKwargs(module_filter_func=Fp8Exclusions())`, which
applies Accelerate's own rule (`filter_linear_layers`: dimensions divisible by 16, not the first and last
Linear layer) plus these names. TransformerEngine: Accelerate's `convert_model` converts every Linear layer
and has no filter, so the combination is refused.
"""
from __future__ import annotations

import fnmatch
import os
from typing import TYPE_CHECKING

import torch

from ..errors import UsageError
from ..formats import simulate

AUTO = "auto"  # --fp32_modules auto: the list chosen by measurement (mixprec.precision.auto_fp32)

if TYPE_CHECKING:
    from ..config.sections import OptimSettings, PrecisionSettings


def match(model: torch.nn.Module, patterns: list[str], model_name: str = "the model") -> dict[str, list[str]]:
    """pattern -> the module names it matches (forward-independent: named_modules order); a transformers
    model's own names (`lm_head`) match too. UsageError for a pattern that matches nothing."""
    names = [name for name, _ in model.named_modules() if name]
    out = {}
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits and hasattr(model, "hf"):  # a transformers model's own names, behind the adapter's `hf.`
            hits = [n for n in names if fnmatch.fnmatchcase(n, f"hf.{pattern}")]
        if not hits:
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise UsageError(f"--fp32_modules {pattern!r} matches no module of {model_name}: give names or globs "
                             f"over its module names ({shown})")
        out[pattern] = hits
    return out


def names_of(matched: dict[str, list[str]]) -> list[str]:
    return list(dict.fromkeys(n for hits in matched.values() for n in hits))


def _fp32(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(_fp32(v) for v in value)
    return value


def _device_type(args, module) -> str:
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.device.type
    param = next(module.parameters(), None)
    return param.device.type if param is not None else "cpu"


class Fp32Forward:
    """A module's forward with autocast off (and no simulated rounding) and its floating inputs in fp32."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        module = self.module
        with torch.autocast(_device_type(args, module), enabled=False), simulate.paused():
            return type(module).forward(module, *_fp32(args), **{k: _fp32(v) for k, v in kwargs.items()})


def keep_fp32(model: torch.nn.Module, names: list[str]) -> None:
    """Give each named module an fp32 forward (see the module docstring)."""
    for name in names:
        module = model.get_submodule(name)
        if not isinstance(module.__dict__.get("forward"), Fp32Forward):
            module.forward = Fp32Forward(module)


def is_fp32(module: torch.nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), Fp32Forward)


def banner_line(info: dict) -> str | None:
    """The banner's `fp32 modules` line from config.yaml's facts, or None without --fp32_modules."""
    if info.get("fp32_plan"):
        from .auto_fp32 import describe as describe_plan

        return f"fp32 modules   {describe_plan(info['fp32_plan'])}"
    if info.get("fp32_modules"):
        return f"fp32 modules   {describe(info['fp32_modules'], info['effective_precision'])}"
    return None


def describe(matched: dict[str, list[str]], precision: str, limit: int = 6) -> str:
    """The banner's line: each pattern and what it matched."""
    parts = []
    for pattern, hits in matched.items():
        shown = ", ".join(hits[:limit]) + (f", ... ({len(hits)} modules)" if len(hits) > limit else "")
        parts.append(f"{pattern!r} -> {shown}")
    note = "" if precision in ("fp16", "bf16", "fp8") else " (no effect: training is fp32)"
    return "; ".join(parts) + note


# --- training ------------------------------------------------------------------------------------------------------

def _engine_refusal(accelerator, prec) -> str | None:
    if prec.effective == "no":
        return None
    if prec.engine == "deepspeed":
        return (f"DeepSpeed {prec.effective} casts the model's weights themselves to {prec.effective} (there is no "
                f"autocast), so no module can compute in fp32: drop --fp32_modules, or train with DDP "
                f"(accelerate_configs/multi_cpu.yaml, multi_gpu.yaml)")
    if accelerator.distributed_type.name == "FSDP":
        return (f"FSDP's mixed-precision policy casts the parameters it gathers to {prec.effective}, so no module "
                f"can compute in fp32: drop --fp32_modules, or train with DDP (accelerate_configs/multi_gpu.yaml)")
    if prec.effective == "fp8" and accelerator.fp8_backend.value == "TE":
        return ("the fp8 backend TE (TransformerEngine): Accelerate's convert_model turns every Linear layer into "
                "an fp8 te.Linear and has no filter: set fp8_config.backend: AO (torchao), or drop --fp32_modules")
    return None


def apply(cfg, model: torch.nn.Module, accelerator, prec, bundle=None, settings: dict | None = None,
          state=None) -> dict[str, list[str]]:
    """Training: match cfg.fp32_modules on the built model (`auto`: measure the plan on `bundle`'s first batches,
    or reuse the one the checkpoint `state` recorded: mixprec.precision.auto_fp32; it goes to `prec.fp32_plan`
    and to `settings`, what checkpoints record), refuse engines that cannot honour them, keep the matched
    modules in fp32, and keep their Linear layers out of fp8. Returns pattern -> matched names."""
    if not cfg.fp32_modules:
        return {}
    auto = AUTO in cfg.fp32_modules
    if auto and len(cfg.fp32_modules) > 1:
        raise UsageError(f"--fp32_modules {','.join(cfg.fp32_modules)}: auto chooses the whole list, it cannot be "
                         f"mixed with names: give --fp32_modules auto, or the names alone")
    matched = {} if auto else match(model, cfg.fp32_modules, f"--model {cfg.model}")
    why = _engine_refusal(accelerator, prec)
    if why:
        raise UsageError(f"--fp32_modules with {why}")
    if auto:
        matched = {AUTO: _auto(cfg.optim, model, accelerator, prec, bundle, settings, state)}
    names = names_of(matched)
    keep_fp32(model, names)
    if prec.effective == "fp8":
        exclusions = getattr(getattr(accelerator, "ao_recipe_handler", None), "module_filter_func", None)
        if not isinstance(exclusions, Fp8Exclusions):
            raise UsageError("--fp32_modules with fp8: the fp8 recipe was not set up by this recipe (a custom "
                             "AORecipeKwargs?): drop --fp32_modules")
        exclusions.bind(model, names)
    return matched


def _auto(optim: OptimSettings, model, accelerator, prec, bundle, settings, state) -> list[str]:
    from . import auto_fp32

    if prec.effective == "fp8":
        raise UsageError("--fp32_modules auto measures overflow and error under fp16/bf16 autocast, not fp8's scaled "
                         "formats: give the list recipes/precision_report.py prints for fp8 (its fp8 section), e.g. "
                         "--fp32_modules net.0,net.4")
    if state is not None and list(state.settings.get("fp32_modules") or []) != [AUTO]:
        return []  # the resume contract refuses the change of --fp32_modules: nothing to measure
    plan = auto_fp32.resolve(optim, model, accelerator, prec.effective, bundle, keep_fp32, state)
    prec.fp32_plan = plan
    if settings is not None:  # what each checkpoint records, so that a resume reuses the plan
        settings["fp32_plan"] = {k: v for k, v in plan.items() if k != "source"}
    return [m["name"] for m in plan["modules"]]


class Fp8Exclusions:
    """torchao's module filter: Accelerate's default rule (`filter_linear_layers` with the first and last Linear
    layers) plus the Linear layers inside the --fp32_modules (bound once the model exists)."""

    def __init__(self):
        self.layers: list[str] = []

    def bind(self, model: torch.nn.Module, names: list[str]) -> None:
        from ..formats.fp8 import converted_linears

        self.layers = [n for n, reason in converted_linears(model, names).items() if reason is not None]

    def __call__(self, module: torch.nn.Module, fqn: str) -> bool:
        from accelerate.utils.ao import filter_linear_layers

        return filter_linear_layers(module, fqn, self.layers)


def fp8_kwargs_handlers(precision: PrecisionSettings, effective: str) -> list:
    """The AO recipe that carries `Fp8Exclusions`, when fp8 trains with --fp32_modules on torchao."""
    if effective != "fp8" or not precision.fp32_modules:
        return []
    from accelerate.utils import AORecipeKwargs, is_torchao_available

    backend = os.environ.get("ACCELERATE_FP8_BACKEND", "").upper() or ("AO" if is_torchao_available() else "TE")
    return [AORecipeKwargs(module_filter_func=Fp8Exclusions())] if backend == "AO" else []
