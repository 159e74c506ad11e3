"""Datasets behind a small registry, built with HF `datasets`, split into train and validation.

Every dataset yields rows {"inputs": tensor, "labels": tensor} and an `info` dict the models read
(task, num_features or image shape or vocabulary, num_classes). Add one with `@register("name", SETTINGS)`,
SETTINGS being its typed `--dataset_args` keys (mixprec.typed_args).

- tabular.py: synthetic (default), lesson (the lesson's random data), file (a local CSV / JSON lines table).
  synthetic and lesson are numpy arrays behind a few of `datasets.Dataset`'s methods (arrays.py), without `datasets`.
- images.py: digits (scikit-learn's handwritten digits, offline), imagefolder (a local folder of images).
- text.py: stdlib (this Python's standard library source, offline), text (local .txt files), random_tokens
  (random ids of any vocabulary: for throughput benchmarks of language models at their real size).
- tokenized.py: text_classification (text and label columns, for transformers classifiers).
- hub.py: hub (`--dataset_name` on the Hugging Face Hub: images or text, told apart by the columns).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .. import preflight
from .. import typed_args
from ..errors import UsageError

if TYPE_CHECKING:
    from ..config.sections import DataSettings
    from datasets import Dataset, DatasetDict

REGISTRY: dict[str, Callable] = {}
# the module that registers each source: a run imports only its own (the synthetic and lesson tables are numpy
# arrays, mixprec.data.arrays: `datasets` is not imported for them)
SOURCES = {"synthetic": "tabular", "lesson": "tabular", "file": "tabular", "digits": "images",
           "imagefolder": "images", "stdlib": "text", "text": "text", "random_tokens": "text", "hub": "hub",
           "text_classification": "tokenized", "chat": "chat"}
ARRAYS_ONLY = {"synthetic", "lesson"}
# the sources that read --train_file, and so --validation_file in the same form
FILE_SOURCES = ("file", "text", "imagefolder", "text_classification", "chat")
SCHEMAS: dict[str, dict] = {}


@dataclass
class DataBundle:
    train: Dataset
    validation: Dataset
    info: dict
    decode: Callable | None = field(default=None, repr=False)  # token ids -> text (language modelling)
    encode: Callable | None = field(default=None, repr=False)  # text -> token ids


def register(name: str, schema: dict):
    """A dataset source `fn(data: DataSettings, cfg: ModelSettings, seed: int) -> DataBundle` under `name`, with
    the schema of its --dataset_args."""
    def deco(fn):
        REGISTRY[name], SCHEMAS[name] = fn, schema
        return fn
    return deco


def _args(data: DataSettings) -> dict:
    """--dataset_args checked against the dataset's settings (type and range of every value)."""
    return typed_args.resolve("--dataset_args", f"dataset {data.dataset}", data.dataset_args, SCHEMAS[data.dataset])


def resolved_args(data: DataSettings) -> dict:
    """The dataset's settings as they will be used (defaults filled in); {} for an unknown dataset."""
    _load_sources(data.dataset)
    return _args(data) if data.dataset in SCHEMAS else {}


def _split(ds: Dataset, val_fraction: float, seed: int, shown: str = "the dataset") -> DatasetDict:
    if not 0 < val_fraction < 1:
        raise UsageError(f"val_fraction={val_fraction} must be between 0 and 1: e.g. --dataset_args val_fraction=0.2")
    from .checks import splittable

    splittable(len(ds), val_fraction, shown)
    return ds.train_test_split(test_size=val_fraction, seed=seed)


def _local_path(data: DataSettings, what: str) -> Path:
    """--train_file, which must exist."""
    if not data.train_file:
        raise UsageError(f"--dataset {data.dataset} needs --train_file PATH ({what})")
    path = Path(data.train_file).expanduser()
    if not preflight.checked_exists(path, "--train_file"):
        raise UsageError(f"--train_file '{data.train_file}' not found: check the path")
    return path


def validation_path(data: DataSettings) -> Path | None:
    """--validation_file, which must exist; None when it is not given (validation is then a share of the data)."""
    if not data.validation_file:
        return None
    path = Path(data.validation_file).expanduser()
    if not preflight.checked_exists(path, "--validation_file"):
        raise UsageError(f"--validation_file '{data.validation_file}' not found: check the path")
    return path


def validation_rows_and_tokens(bundle: DataBundle) -> tuple[int, int | None]:
    """The validation split's rows, and for token data its tokens: the target tokens of a language model (labels
    not -100), the input tokens of a text classifier (not padding); None for other data."""
    table, info = bundle.validation, bundle.info
    if "vocab_size" not in info or len(table) == 0:
        return len(table), None
    if info.get("task") == "classification":
        inputs = table.with_format("numpy", columns=["inputs"])[:]["inputs"]
        return len(table), int((inputs != info.get("pad_token_id", -1)).sum())
    labels = table.with_format("numpy", columns=["labels"])[:]["labels"]
    return len(table), int((labels != -100).sum())


def cached(name: str, key: str, make: Callable[[], Dataset | DatasetDict]) -> DatasetDict | Dataset:
    """A dataset the recipe generates (digits, the stdlib corpus), saved once under the HF datasets cache
    (`HF_DATASETS_CACHE/mixprec/<name>-<hash of key>`) and loaded from disk after that, so that `map`
    caches its results next to it like for any downloaded dataset. Written to a temporary folder and
    renamed, so that a crash or a parallel run never leaves half a dataset."""
    from datasets import config as hf_config
    from datasets import load_from_disk

    root = Path(hf_config.HF_DATASETS_CACHE) / "mixprec"
    final = root / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if not final.is_dir():
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        make().save_to_disk(str(tmp))
        try:
            os.replace(tmp, final)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    return load_from_disk(str(final))


def _load_sources(name: str | None = None):
    """The module of source `name` (they register themselves); all of them for a name that is not known."""
    import importlib

    for module in [SOURCES[name]] if name in SOURCES else sorted(set(SOURCES.values())):
        importlib.import_module(f"{__name__}.{module}")


def build(cfg) -> DataBundle:
    """The dataset of `cfg`, checked: both splits have rows, and classification labels are in 0..C-1."""
    _load_sources(cfg.dataset)
    if cfg.dataset not in ARRAYS_ONLY and not sys.stderr.isatty():  # progress bars on a terminal; not in logs
        import datasets

        datasets.disable_progress_bars()
    if cfg.dataset not in REGISTRY:
        raise UsageError(f"--dataset {cfg.dataset!r} is not known: pick one of {', '.join(sorted(REGISTRY))}")
    if cfg.dataset_name and cfg.dataset not in ("hub", "text_classification", "chat"):
        raise UsageError(f"--dataset_name {cfg.dataset_name} is a Hugging Face Hub dataset: add --dataset hub (or "
                         f"--dataset text_classification for a transformers classifier)")
    if cfg.validation_file and cfg.dataset not in FILE_SOURCES:
        raise UsageError(f"--validation_file is read by the sources that read --train_file ({', '.join(FILE_SOURCES)}),"
                         f" not by --dataset {cfg.dataset}: drop it, or set the validation share with --dataset_args "
                         f"val_fraction=F where the dataset has one")
    bundle = REGISTRY[cfg.dataset](cfg.data, cfg, cfg.seed)  # a source: the data section, the model's, the seed
    bundle.info.setdefault("validation_from", "the dataset's validation split")
    for split, table in (("training", bundle.train), ("validation", bundle.validation)):
        if len(table) == 0:
            raise UsageError(f"the {split} split of dataset {cfg.dataset} is empty: give more data or change "
                             f"--dataset_args val_fraction")
        if "num_classes" in bundle.info:
            check_labels(table, bundle.info["num_classes"], f"the {split} split of dataset {cfg.dataset}")
    bundle.train = bundle.train.with_format("torch", columns=["inputs", "labels"])
    bundle.validation = bundle.validation.with_format("torch", columns=["inputs", "labels"])
    return bundle


def check_labels(table, num_classes: int, where: str) -> None:
    labels = table.with_format("numpy", columns=["labels"])[:]["labels"]
    low, high = labels.min(), labels.max()
    if low < 0 or high >= num_classes:
        bad = low if low < 0 else high
        raise UsageError(f"{where} has the label {bad}, outside 0..{num_classes - 1}: labels must be class numbers "
                         f"from 0 to the number of classes - 1")
