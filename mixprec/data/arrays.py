"""Tables that are numpy arrays already (the synthetic and lesson data), without loading HF `datasets`.

`datasets` and what it imports (pyarrow, pandas, the Hub client) take 0.6 to 0.9 s to import on the 2-core
CPU: more than the default run trains. The tables generated in memory need none of it, so they are kept as
arrays behind the few methods of `datasets.Dataset` that the pipeline uses: `len`, `select`,
`train_test_split` (the same rows as `datasets`' with the same seed: tests/test_data_arrays.py),
`with_format("numpy" | "torch", columns)` and indexing by row, rows or column. The sources that read files
or the Hub still use `datasets`.
"""
from __future__ import annotations

import math

import numpy as np
import torch


class ArrayTable:
    def __init__(self, columns: dict[str, np.ndarray], format: str | None = None, shown: list[str] | None = None):
        lengths = {len(v) for v in columns.values()}
        if len(lengths) != 1:
            raise ValueError(f"columns of different lengths: {sorted(lengths)}")
        self.columns, self.format = columns, format
        self.column_names = list(shown if shown is not None else columns)

    @classmethod
    def from_dict(cls, columns: dict) -> ArrayTable:
        return cls({name: np.asarray(values) for name, values in columns.items()})

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    @property
    def in_memory_bytes(self) -> int:
        return sum(int(v.nbytes) for v in self.columns.values())

    def _out(self, value):
        if self.format == "torch":
            return torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) \
                else torch.tensor(value)
        return value

    def __getitem__(self, key):
        if isinstance(key, str):
            return self._out(self.columns[key])
        if isinstance(key, (int, np.integer)):
            return {name: self._out(self.columns[name][key]) for name in self.column_names}
        if not isinstance(key, slice):
            key = np.asarray(key, dtype=np.int64)
        return {name: self._out(self.columns[name][key]) for name in self.column_names}

    def with_format(self, format: str | None = None, columns: list[str] | None = None) -> ArrayTable:
        return ArrayTable(self.columns, format, columns)

    def select(self, indices) -> ArrayTable:
        index = np.asarray(indices, dtype=np.int64)
        return ArrayTable({name: values[index] for name, values in self.columns.items()}, self.format,
                          self.column_names)

    def train_test_split(self, test_size: float, seed: int) -> dict[str, ArrayTable]:
        """`datasets.Dataset.train_test_split(test_size=<float>, seed=seed)`'s split: a permutation from
        `np.random.default_rng(seed)`, its first ceil(test_size * rows) rows for the test side."""
        n_test = math.ceil(test_size * len(self))
        permutation = np.random.default_rng(seed).permutation(len(self))
        return {"train": self.select(permutation[n_test:]), "test": self.select(permutation[:n_test])}
