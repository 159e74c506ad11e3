"""Tables of numbers: the lesson's data, a learnable synthetic problem, and local CSV / JSON-lines files.

- synthetic (default): a learnable 10-class problem with 100 features (Gaussian class clusters).
- lesson: the lesson's exact data, randn(500, 100) inputs with random labels (nothing to learn).
- file: a local CSV or JSON-lines file (--train_file) with numeric feature columns and a 'label' column;
  validation is --validation_file (the same columns), else a seeded share of the rows (val_fraction).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import glob
import json

import numpy as np
import torch
from .. import preflight
from ..errors import UsageError
from ..typed_args import Setting, fraction, positive
from . import DataBundle, _args, _local_path, _split, checks, register
from .arrays import ArrayTable

if TYPE_CHECKING:
    from ..config.sections import DataSettings, ModelSettings

SYNTHETIC = {"num_samples": Setting(8000, int, 2), "num_features": positive(100), "num_classes": Setting(10, int, 2),
             "clusters_per_class": positive(4), "separation": Setting(0.5, float, 0), "val_fraction": fraction(0.2)}
LESSON = {"num_samples": positive(500), "num_val": positive(100)}
FILE = {"label_column": Setting("label", str), "val_fraction": fraction(0.2)}


@register("synthetic", SYNTHETIC)
def synthetic(data: DataSettings, cfg: ModelSettings, seed: int) -> DataBundle:
    """Gaussian clusters: each class owns a few random centres; an input is a centre plus unit noise.
    Several centres per class make the classes not linearly separable, so the hidden layers matter."""
    a = _args(data)
    preflight.require_memory(a["num_samples"] * (a["num_features"] * 20 + 16), f"--dataset_args num_samples="
                             f"{a['num_samples']}, num_features={a['num_features']}", "give fewer samples or features")
    rng = np.random.default_rng(1234)  # the dataset is fixed; --seed changes training, not the data
    centres = rng.standard_normal((a["num_classes"] * a["clusters_per_class"], a["num_features"]))
    cluster = rng.integers(0, len(centres), a["num_samples"])
    inputs = centres[cluster] * a["separation"] + rng.standard_normal((a["num_samples"], a["num_features"]))
    labels = cluster % a["num_classes"]
    ds = ArrayTable.from_dict({"inputs": inputs.astype(np.float32), "labels": labels.astype(np.int64)})
    parts = _split(ds, a["val_fraction"], seed=1234)
    return DataBundle(parts["train"], parts["test"], {"task": "classification", "num_features": a["num_features"],
                                                      "num_classes": a["num_classes"],
                                                      "validation_from": f"a seeded {a['val_fraction']:.0%} share"})


@register("lesson", LESSON)
def lesson(data: DataSettings, cfg: ModelSettings, seed: int) -> DataBundle:
    """The lesson's data: torch.randn(500, 100) and torch.randint(0, 10, (500,)), plus 100 held out."""
    a = _args(data)
    gen = torch.Generator().manual_seed(seed)
    n = a["num_samples"] + a["num_val"]
    preflight.require_memory(n * 100 * 12, f"--dataset_args num_samples={a['num_samples']}, num_val={a['num_val']}",
                             "give fewer samples")
    inputs, labels = torch.randn(n, 100, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    ds = ArrayTable.from_dict({"inputs": inputs.numpy(), "labels": labels.numpy()})
    train = ds.select(range(a["num_samples"]))
    val = ds.select(range(a["num_samples"], n))
    return DataBundle(train, val, {"task": "classification", "num_features": 100, "num_classes": 10,
                                   "validation_from": "num_val rows drawn after the training rows"})


@register("file", FILE)
def local_file(data: DataSettings, cfg: ModelSettings, seed: int) -> DataBundle:
    """A local CSV / JSON-lines table: numeric feature columns and an integer 'label' column. Validation is
    --validation_file (a table of the same columns, read with the same checks), else a seeded share of the rows."""
    a = _args(data)
    path = _local_path(data, "a .csv or .jsonl file")
    val_path = checks.validation_file(data)
    source = checks.named("--train_file", data.train_file)
    train, features = _table(path, source, a["label_column"], data.allow_nonfinite_data)
    num_classes = int(max(train["labels"])) + 1
    info = {"task": "classification", "num_features": len(features), "num_classes": num_classes}
    if val_path is None:
        parts = _split(train, a["val_fraction"], seed=1234, shown=source)
        origin = (f"a seeded {checks.share(a['val_fraction'])} share of --train_file's rows "
                  f"(--dataset_args val_fraction)")
        return DataBundle(parts["train"], parts["test"], {**info, "validation_from": origin})
    val_source = checks.named("--validation_file", data.validation_file)
    validation, _ = _table(val_path, val_source, a["label_column"], data.allow_nonfinite_data, (features, source))
    checks.classes_seen(train.with_format("numpy")["labels"], validation.with_format("numpy")["labels"], source,
                        val_source)
    return DataBundle(train, validation, {**info, "validation_from": val_source})


def _table(path, source: str, label: str, allow_nonfinite: bool, like: tuple[list[str], str] | None = None):
    """(rows {inputs, labels}, the feature columns) of the table at `path`, every check naming `source`; `like`:
    (the training table's feature columns, its source), which this table's must equal (taken in their order)."""
    kind = {".csv": "csv", ".json": "json", ".jsonl": "json"}.get(path.suffix.lower())
    if kind is None or not path.is_file():
        raise UsageError(f"{source} must be a file ending in .csv, .json or .jsonl")
    ds = _read_table(path, kind, source)
    if label not in ds.column_names:
        raise UsageError(f"{source} has no '{label}' column: add it or set --dataset_args label_column=NAME")
    features = [c for c in ds.column_names if c != label]
    bad = [c for c in features if not _numeric(ds.features[c])]
    if not features or bad:
        raise UsageError(f"{source}: " + (f"column '{bad[0]}' is not numeric ({ds.features[bad[0]]}): every column "
                         f"but '{label}' must hold numbers" if bad else f"no feature columns besides '{label}'"))
    if like is not None:
        features = _same_columns(features, like, source)
    if not _integer(ds.features[label]):
        raise UsageError(f"{source}: the '{label}' column holds {ds.features[label]}, not class numbers 0, 1, 2, ...: "
                         f"give integer labels")
    ds = ds.map(lambda b: {"inputs": np.stack([b[c] for c in features], 1).astype(np.float32),
                           "labels": b[label]}, batched=True, remove_columns=ds.column_names)
    if not allow_nonfinite:
        checks.finite_features(ds.with_format("numpy")["inputs"], features, source, 2 if kind == "csv" else 1)
    return ds, features


def _same_columns(features: list[str], like: tuple[list[str], str], source: str) -> list[str]:
    """The training table's feature columns, when this table has the same ones (in any order)."""
    expected, train_source = like
    if set(features) != set(expected):
        odd = sorted(set(features) - set(expected)) or sorted(set(expected) - set(features))
        raise UsageError(f"{source} has the feature columns {', '.join(features)}; {train_source} has "
                         f"{', '.join(expected)} (column '{odd[0]}'): give both files the same columns")
    return expected


def _read_table(path, kind: str, source: str):
    """The file as a `datasets` table; a malformed or empty file is one line naming `source`."""
    from datasets import load_dataset
    from datasets.utils import logging as datasets_logging

    with open(path, errors="replace") as f:
        lines = sum(1 for line in f if line.strip())
    if lines <= (1 if kind == "csv" else 0):  # a CSV's first line is its header
        raise UsageError(f"{source} has no rows: give a file with data")
    if kind == "json":
        _check_json_lines(path, source)
    verbosity = datasets_logging.get_verbosity()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)  # its parsers log errors of their own before raising
    try:  # data_files is a glob pattern: the path is escaped so that '[1]' or '*' in it are taken literally
        ds = load_dataset(kind, data_files=glob.escape(str(path)), split="train")
    except Exception as err:  # noqa: BLE001  (pyarrow / json / csv parse errors of every kind)
        first = checks.deepest_message(err)
        raise UsageError(f"{source} could not be read as {kind.upper()}: {first}: fix the file") from None
    finally:
        datasets_logging.set_verbosity(verbosity)
    if len(ds) == 0:
        raise UsageError(f"{source} has no rows: give a file with data")
    return ds


def _check_json_lines(path, source: str) -> None:
    rows = []
    with open(path, errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as err:
                raise UsageError(f"{source}: line {number} is not valid JSON ({err.msg}): write one JSON object per "
                                 f"line") from None
            if not isinstance(row, dict):
                raise UsageError(f"{source}: line {number} is not a JSON object: write one object per line, e.g. "
                                 f"{{\"f0\": 1.5, \"label\": 0}}")
            rows.append((number, dict.fromkeys(row)))
    checks.same_keys(rows, source)


def _numeric(feature) -> bool:
    return getattr(feature, "dtype", "").startswith(("int", "uint", "float", "bool"))


def _integer(feature) -> bool:
    return getattr(feature, "dtype", "").startswith(("int", "uint"))
