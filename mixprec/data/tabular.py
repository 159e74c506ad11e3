"""Tables of numbers: the lesson's data, a learnable synthetic problem, and local CSV / JSON-lines files.

- synthetic (default): a learnable 10-class problem with 100 features (Gaussian class clusters).
- lesson: the lesson's exact data, randn(500, 100) inputs with random labels (nothing to learn).
- file: a local CSV or JSON-lines file (--train_file) with numeric feature columns and a 'label' column.
"""
from __future__ import annotations

import numpy as np
import torch
from datasets import Dataset, load_dataset

from ..errors import UsageError
from . import DataBundle, _args, _local_path, _split, register


@register("synthetic")
def synthetic(cfg) -> DataBundle:
    """Gaussian clusters: each class owns a few random centres; an input is a centre plus unit noise.
    Several centres per class make the classes not linearly separable, so the hidden layers matter."""
    a = _args(cfg, {"num_samples": 8000, "num_features": 100, "num_classes": 10, "clusters_per_class": 4,
                    "separation": 0.5, "val_fraction": 0.2})
    rng = np.random.default_rng(1234)  # the dataset is fixed; --seed changes training, not the data
    centres = rng.standard_normal((a["num_classes"] * a["clusters_per_class"], a["num_features"]))
    cluster = rng.integers(0, len(centres), a["num_samples"])
    inputs = centres[cluster] * a["separation"] + rng.standard_normal((a["num_samples"], a["num_features"]))
    labels = cluster % a["num_classes"]
    ds = Dataset.from_dict({"inputs": inputs.astype(np.float32), "labels": labels.astype(np.int64)})
    parts = _split(ds, a["val_fraction"], seed=1234)
    return DataBundle(parts["train"], parts["test"], {"task": "classification", "num_features": a["num_features"],
                                                      "num_classes": a["num_classes"]})


@register("lesson")
def lesson(cfg) -> DataBundle:
    """The lesson's data: torch.randn(500, 100) and torch.randint(0, 10, (500,)), plus 100 held out."""
    a = _args(cfg, {"num_samples": 500, "num_val": 100})
    gen = torch.Generator().manual_seed(cfg.seed)
    n = a["num_samples"] + a["num_val"]
    inputs, labels = torch.randn(n, 100, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    ds = Dataset.from_dict({"inputs": inputs.numpy(), "labels": labels.numpy()})
    train = ds.select(range(a["num_samples"]))
    val = ds.select(range(a["num_samples"], n))
    return DataBundle(train, val, {"task": "classification", "num_features": 100, "num_classes": 10})


@register("file")
def local_file(cfg) -> DataBundle:
    """A local CSV / JSON-lines table: numeric feature columns and an integer 'label' column."""
    a = _args(cfg, {"label_column": "label", "val_fraction": 0.2})
    path = _local_path(cfg, "a .csv or .jsonl file")
    kind = {".csv": "csv", ".json": "json", ".jsonl": "json"}.get(path.suffix.lower())
    if kind is None or not path.is_file():
        raise UsageError(f"--train_file '{cfg.train_file}' must be a file ending in .csv, .json or .jsonl")
    ds = load_dataset(kind, data_files=str(path), split="train")
    label = a["label_column"]
    if label not in ds.column_names:
        raise UsageError(f"--train_file '{cfg.train_file}' has no '{label}' column: add it or set "
                         f"--dataset_args label_column=NAME")
    features = [c for c in ds.column_names if c != label]
    ds = ds.map(lambda b: {"inputs": np.stack([b[c] for c in features], 1).astype(np.float32),
                           "labels": b[label]}, batched=True, remove_columns=ds.column_names)
    num_classes = int(max(ds["labels"])) + 1
    parts = _split(ds, a["val_fraction"], seed=1234)
    return DataBundle(parts["train"], parts["test"], {"task": "classification", "num_features": len(features),
                                                      "num_classes": num_classes})
