"""Strategies for tests/test_generated_input.py: settings drawn from their declarations, and damaged data files.

Every field of `mixprec.config.TrainConfig` is drawn from its declared type (and choices), and every key of the
drawn model's and dataset's schema (`mixprec.typed_args.Setting`) from its type and range, both inside and beyond
it: huge, tiny, negative, zero, NaN, inf, the wrong type, unicode, empty. A setting added to the declarations is
drawn without a change here. Valid values of `max_steps` are drawn up to 40 (a longer run is a long run, not
bad input); valid sizes are drawn small or huge (beyond any memory), not in between.
"""
from __future__ import annotations

import json
import math

import yaml
from hypothesis import strategies as st

from mixprec import data, models
from mixprec.config import FIELDS
from mixprec.typed_args import Setting

HUGE_INTS = [2**31 - 1, 2**31, 2**32, 2**63, 10**12, 10**30]
ODD_FLOATS = [0.0, -0.0, 5e-324, 1e-300, -1.0, 1e300, 1.7e308, math.nan, math.inf, -math.inf]
UNICODE = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=12)
ODD_TEXT = st.sampled_from(["", " ", "None", "null", "[1,2", "a,b", "é☃𝛑", "x" * 300, "../..", "1e3", "-"]) | UNICODE
# settings that name paths and processes: drawn as text that names nothing (the listed cases cover real ones)
PATHS = {"config", "output_dir", "train_file", "resume_from_checkpoint", "model_name_or_path", "config_name",
         "tokenizer_name"}
RUN_LENGTH = {"max_steps": 40}


def _int_values(low, high, bound=None) -> st.SearchStrategy:
    low = -5 if low is None else int(low)
    top = low + 40 if bound is None else bound
    inside = st.integers(low, top if high is None else min(int(high), top))
    beyond = st.sampled_from([low - 1, -1, 0, -(2**63)] + ([] if bound else HUGE_INTS))
    return st.one_of(inside, beyond)


def _float_values(low, high) -> st.SearchStrategy:
    low_ = -1.0 if low is None else float(low)
    high_ = low_ + 10.0 if high is None else float(high)
    return st.one_of(st.floats(low_, high_, allow_nan=False), st.sampled_from(ODD_FLOATS))


def typed(typ, low=None, high=None, item=int, bound=None) -> st.SearchStrategy:
    """Python values for a declared type: in range and beyond, and of other types."""
    wrong = st.one_of(ODD_TEXT, st.sampled_from([None, True, [], {}, [1, "a"], {"a": 1}]))
    if typ is bool:
        right = st.booleans()
    elif typ is int:
        right = _int_values(low, high, bound)
    elif typ is float:
        right = _float_values(low, high)
    elif typ is list:
        right = st.lists(typed(item, low, high), min_size=0, max_size=3)
    elif typ is dict:
        right = st.just({})
    else:
        right = ODD_TEXT
    return st.one_of(right, right, wrong)  # two to one for the declared type


def setting_value(spec: Setting) -> st.SearchStrategy:
    return typed(spec.type, spec.low, spec.high, spec.item)


@st.composite
def kv_settings(draw, schema: dict) -> dict:
    """A few keys of a model's or dataset's schema with drawn values, sometimes an unknown key."""
    keys = sorted(schema)
    chosen = draw(st.lists(st.sampled_from(keys), max_size=2, unique=True)) if keys else []
    out = {key: draw(setting_value(schema[key])) for key in chosen}
    if draw(st.integers(0, 9)) == 0:
        out[draw(ODD_TEXT.filter(lambda k: k.strip() and not any(c in k for c in "=,[]{}")))] = 1
    return out


def field_value(name: str) -> st.SearchStrategy:
    meta = FIELDS[name].metadata
    if name in PATHS:
        return ODD_TEXT
    if meta["choices"]:
        return st.one_of(st.sampled_from(meta["choices"]), ODD_TEXT)
    if name == "model":
        return st.one_of(st.sampled_from(sorted(models.REGISTRY)), ODD_TEXT)
    if name == "dataset":
        return st.one_of(st.sampled_from(sorted(data.REGISTRY)), ODD_TEXT)
    return typed(meta["type"], bound=RUN_LENGTH.get(name))


@st.composite
def settings(draw) -> dict:
    """One to three settings of TrainConfig with drawn values; model_args and dataset_args from the schemas of
    the model and dataset in the draw (the default's when not drawn)."""
    names = draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=3, unique=True))
    drawn = {name: draw(field_value(name)) for name in names if FIELDS[name].metadata["type"] is not dict}
    model = drawn.get("model") if drawn.get("model") in models.REGISTRY else "mlp"
    dataset = drawn.get("dataset") if drawn.get("dataset") in data.SCHEMAS else "synthetic"
    if "model_args" in names:
        drawn["model_args"] = draw(kv_settings(models.REGISTRY[model][1]))
    if "dataset_args" in names:
        drawn["dataset_args"] = draw(kv_settings(data.SCHEMAS[dataset]))
    return drawn


def flag_text(value) -> str:
    """How a user would type the value after its flag."""
    if isinstance(value, dict):
        return ",".join(f"{k}={flag_text(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(flag_text(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def as_flags(drawn: dict) -> list[str]:
    args = []
    for name, value in drawn.items():
        if FIELDS[name].metadata["type"] is bool and isinstance(value, bool):
            args.append(f"--{name}" if value else f"--no-{name}")
        elif FIELDS[name].metadata["type"] is list and isinstance(value, list):
            args.append(f"--{name}={','.join(flag_text(v) for v in value)}")
        else:
            args.append(f"--{name}={flag_text(value)}")
    return args


def as_yaml(drawn: dict) -> str:
    return yaml.safe_dump({k: v for k, v in drawn.items() if k != "config"}, allow_unicode=True)


# --- damaged data files ------------------------------------------------------------------------------------------

ODD_CELLS = ["nan", "NaN", "inf", "-inf", "", "1e400", "x", "é", "0x10", "\"1,2\"", "1;2"]


@st.composite
def table_file(draw) -> tuple[str, bytes]:
    """A CSV or JSON-lines file of features and labels: whole, or damaged."""
    rows = draw(st.sampled_from([0, 1, 2, 5, 60]))
    labels = draw(st.sampled_from([[0, 1], [0, 1, 2], [-1, 0], [0, 2147483647], [0.5, 1]]))
    table = [[float(i), float(i % 7), labels[i % len(labels)]] for i in range(rows)]
    damage = draw(st.sampled_from(["none", "cell", "ragged", "non-UTF-8", "binary", "truncated", "mixed keys",
                                   "header only", "empty"]))
    kind = draw(st.sampled_from(["csv", "jsonl"]))
    cells = [[json.dumps(v) if kind == "jsonl" else str(v) for v in row] for row in table]
    if damage == "cell" and rows:
        cells[draw(st.integers(0, rows - 1))][draw(st.integers(0, 1))] = draw(st.sampled_from(ODD_CELLS))
    if kind == "csv":
        lines = ["f0,f1,label"] + [",".join(row) for row in cells]
        if damage == "ragged" and rows:
            lines.insert(draw(st.integers(1, len(lines))), "1,2,3,4")
    else:
        lines = ['{"f0": %s, "f1": %s, "label": %s}' % tuple(row) for row in cells]
        if damage == "mixed keys" and rows:
            lines.insert(draw(st.integers(0, len(lines))), '{"g0": 1, "label": 0}')
        if damage == "ragged" and rows:
            lines.insert(draw(st.integers(0, len(lines))), '{"f0": 1, "label": 0')
    text = "".join(line + "\n" for line in lines).encode()
    if damage == "non-UTF-8":
        text = text[: len(text) // 2] + b"\xff\xfe" + text[len(text) // 2:]
    elif damage == "binary":
        text = text[: len(text) // 2] + bytes(range(32)) + text[len(text) // 2:]
    elif damage == "truncated":
        text = text[: draw(st.integers(0, max(0, len(text) - 1)))]
    elif damage == "header only":
        text = text.split(b"\n", 1)[0] + b"\n"
    elif damage == "empty":
        text = b""
    return f"d.{kind}", text


@st.composite
def text_file(draw) -> bytes:
    """A text corpus for --dataset text: whole, or damaged."""
    base = ("def f(x):\n    return x + 1\n" * 40).encode()
    damage = draw(st.sampled_from(["none", "empty", "blank", "non-UTF-8", "binary", "one byte", "unicode"]))
    return {"none": base, "empty": b"", "blank": b"\n \n\t\n", "non-UTF-8": base[:100] + b"\xff\xfe\xfd" + base[100:],
            "binary": base[:100] + bytes(range(32)) + base[100:], "one byte": b"a",
            "unicode": ("é☃𝛑 " * 200).encode()}[damage]


@st.composite
def image_folder(draw) -> list[tuple[str, int, str]]:
    """An image folder: (class, image number, damage) for each image; damage: none, truncated, empty, not an
    image."""
    classes = draw(st.sampled_from([1, 2, 3]))
    per_class = draw(st.sampled_from([1, 3, 6]))
    images = [(f"c{c}", i, "none") for c in range(classes) for i in range(per_class)]
    if draw(st.booleans()):
        k = draw(st.integers(0, len(images) - 1))
        images[k] = (*images[k][:2], draw(st.sampled_from(["truncated", "empty", "not an image"])))
    return images

