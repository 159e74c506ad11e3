"""Typed settings of models and datasets (`--model_args`, `--dataset_args`): each model and dataset declares
its keys with a type, a default and a range, and a bad key or value is one line naming the key, the value
and what is accepted."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import UsageError


@dataclass(frozen=True)
class Setting:
    default: Any
    type: type = int  # int, float, str, bool, or list (of `item`)
    low: float | None = None  # inclusive
    high: float | None = None  # inclusive, or exclusive with open_high
    open_low: bool = False
    open_high: bool = False
    optional: bool = False  # None (null) is accepted
    item: type = int  # for lists

    def accepted(self) -> str:
        what = {int: "an integer", float: "a number", str: "a text", bool: "true or false",
                list: f"a list of {'integers' if self.item is int else 'numbers'} like [64,32]"}[self.type]
        if self.low is not None and self.high is not None:
            what += (f" {'above' if self.open_low else 'from'} {self.low:g} {'and below' if self.open_high else 'to'}"
                     f" {self.high:g}")
        elif self.low is not None:
            what += f" {'above' if self.open_low else 'of at least'} {self.low:g}"
        return what + (" (or null)" if self.optional else "")

    def _in_range(self, v) -> bool:
        if self.low is not None and (v < self.low or (self.open_low and v == self.low)):
            return False
        return self.high is None or not (v > self.high or (self.open_high and v == self.high))

    def _scalar(self, typ: type, value):
        if typ is bool:
            return value if isinstance(value, bool) else None
        if isinstance(value, bool) or (typ is str) != isinstance(value, str):
            return None
        if typ is int:
            return value if isinstance(value, int) else int(value) if isinstance(value, float) and value.is_integer() else None
        if typ is float:
            return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
        return value

    def check(self, value):
        """The value converted, or None when it is not acceptable (and not an accepted None)."""
        if self.type is list:
            if not isinstance(value, (list, tuple)) or not value:
                return None
            items = [self._scalar(self.item, v) for v in value]
            return list(items) if all(v is not None and self._in_range(v) for v in items) else None
        converted = self._scalar(self.type, value)
        if converted is None or (self.type in (int, float) and not self._in_range(converted)):
            return None
        return converted


def resolve(flag: str, owner: str, given: dict, schema: dict[str, Setting]) -> dict:
    """The settings for `owner` (a model or dataset): the defaults, then `given`, every value checked."""
    out = {key: spec.default for key, spec in schema.items()}
    for key, value in given.items():
        if key not in schema:
            raise UsageError(f"unknown {flag} key '{key}' for {owner}: valid keys are {', '.join(schema) or 'none'}")
        spec = schema[key]
        if value is None and spec.optional:
            out[key] = None
            continue
        checked = spec.check(value)
        if checked is None:
            raise UsageError(f"{flag} {key}={value!r} for {owner} is not valid: give {spec.accepted()}")
        out[key] = checked
    return out


def fraction(default: float) -> Setting:
    return Setting(default, float, 0, 1, open_low=True, open_high=True)


def positive(default, optional: bool = False) -> Setting:
    return Setting(default, int, 1, optional=optional)
