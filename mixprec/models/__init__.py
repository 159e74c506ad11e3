"""Models behind a registry. A new model is one file here plus one config in recipes/configs/.

A model file registers one or more names with `@register("name", **preset)`; `build` calls the
registered factory with the dataset's `info` and the preset, overridden by `--model_args`.
Every model maps `inputs` to logits whose last dimension is the number of classes (or tokens).
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Callable

import torch

from ..errors import UsageError

REGISTRY: dict[str, tuple[Callable, dict]] = {}


def register(name: str, **preset):
    def deco(factory):
        REGISTRY[name] = (factory, preset)
        return factory
    return deco


def _load_all():
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


def names() -> list[str]:
    _load_all()
    return sorted(REGISTRY)


def supports(name: str, option: str) -> bool:
    """Whether model `name` offers `option` (a factory lists them in its `supports` attribute)."""
    _load_all()
    return name in REGISTRY and option in getattr(REGISTRY[name][0], "supports", ())


def setting(name: str, model_args: dict | None, key: str):
    """The value `key` will have for model `name`: --model_args, else the preset, else the factory's
    default; None when the model has no such setting (or is not known: `build` says so)."""
    _load_all()
    if name not in REGISTRY:
        return None
    factory, preset = REGISTRY[name]
    param = inspect.signature(factory).parameters.get(key)
    default = None if param is None or param.default is inspect.Parameter.empty else param.default
    return {key: default, **preset, **(model_args or {})}.get(key) if param is not None else None


def build(name: str, info: dict, model_args: dict | None = None) -> torch.nn.Module:
    _load_all()
    if name not in REGISTRY:
        raise UsageError(f"--model {name!r} is not known: pick one of {', '.join(sorted(REGISTRY))}")
    factory, preset = REGISTRY[name]
    params = inspect.signature(factory).parameters
    settings = {**preset, **(model_args or {})}
    unknown = sorted(set(settings) - set(params) - {"info"})
    if unknown:
        valid = ", ".join(p for p in params if p != "info")
        raise UsageError(f"unknown --model_args key '{unknown[0]}' for model {name}: valid keys are {valid}")
    return factory(info=info, **settings)
