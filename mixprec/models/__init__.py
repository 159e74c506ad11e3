"""Models behind a registry. A new model is one file here plus one config in recipes/configs/.

A model file registers one or more names with `@register("name", SETTINGS, **preset)`, SETTINGS being its
typed `--model_args` keys (mixprec.typed_args); `build` calls the registered factory with the dataset's `info`
and the settings: the defaults, then the preset, then `--model_args`, each value checked.
Every model maps `inputs` to logits whose last dimension is the number of classes (or tokens).
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

from .. import typed_args
from ..errors import UsageError

REGISTRY: dict[str, tuple[Callable, dict, dict]] = {}


def register(name: str, schema: dict, **preset):
    def deco(factory):
        REGISTRY[name] = (factory, schema, preset)
        return factory
    return deco


def _load_all():
    for mod in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{mod.name}")


def supports(name: str, option: str) -> bool:
    """Whether model `name` offers `option` (a factory lists them in its `supports` attribute)."""
    _load_all()
    return name in REGISTRY and option in getattr(REGISTRY[name][0], "supports", ())


def setting(name: str, model_args: dict | None, key: str):
    """The value `key` will have for model `name` (None when the model has no such setting, or is not known:
    `build` says so)."""
    _load_all()
    if name not in REGISTRY or key not in REGISTRY[name][1]:
        return None
    _, schema, preset = REGISTRY[name]
    return typed_args.resolve("--model_args", f"model {name}", {**preset, **(model_args or {})}, schema)[key]


def resolved_args(name: str, model_args: dict | None) -> dict:
    """The model's settings as they will be used (defaults, preset, --model_args); {} for an unknown model."""
    _load_all()
    if name not in REGISTRY:
        return {}
    _, schema, preset = REGISTRY[name]
    return typed_args.resolve("--model_args", f"model {name}", {**preset, **(model_args or {})}, schema)


def build(name: str, info: dict, model_args: dict | None = None):
    _load_all()
    if name not in REGISTRY:
        raise UsageError(f"--model {name!r} is not known: pick one of {', '.join(sorted(REGISTRY))}")
    factory, schema, preset = REGISTRY[name]
    values = typed_args.resolve("--model_args", f"model {name}", {**preset, **(model_args or {})}, schema)
    return factory(info=info, **values)
