"""The default command trains before it imports what it does not need to train: `datasets` never (the synthetic
data are numpy arrays: mixprec.data.arrays, the same rows as `datasets` would give), DeepSpeed and matplotlib
only when the run is finished (Accelerate's `save_model`, metrics.png). docs/performance.md, "Start-up beyond
Accelerate's own", says what each costs; benchmarks/startup.py measures the whole."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from datasets import Dataset

from helpers import HOOKS, TRAIN
from mixprec import config, data
from mixprec.data.arrays import ArrayTable


def test_the_default_run_imports_no_datasets_and_deepspeed_and_matplotlib_only_when_finished(tmp_path):
    record = tmp_path / "first_imports.json"
    env = {**os.environ, "FIRST_IMPORTS": str(record)}
    proc = subprocess.run([sys.executable, str(HOOKS / "first_imports.py"), str(TRAIN), "--max_steps", "2",
                           "--output_dir", str(tmp_path / "run")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.png").is_file()  # still drawn, at the end
    first = json.loads(record.read_text())
    assert "datasets" not in first, first.get("datasets")
    for package in ("deepspeed", "matplotlib"):  # if at all (DeepSpeed may not be installed)
        stack = first.get(package, ["training/run.py:finish"])
        assert any(frame.endswith("training/run.py:finish") for frame in stack), (package, stack)


@pytest.mark.parametrize("rows,fraction,seed", [(8000, 0.2, 1234), (7, 0.5, 0), (101, 0.13, 99)])
def test_array_tables_split_and_read_as_datasets_does(rows, fraction, seed):
    rng = np.random.default_rng(seed)
    columns = {"inputs": rng.standard_normal((rows, 3)).astype(np.float32),
               "labels": rng.integers(0, 5, rows).astype(np.int64)}
    ours = ArrayTable.from_dict(columns).train_test_split(test_size=fraction, seed=seed)
    theirs = Dataset.from_dict(columns).train_test_split(test_size=fraction, seed=seed)
    for split in ("train", "test"):
        mine = ours[split].with_format("torch", columns=["inputs", "labels"])
        other = theirs[split].with_format("torch", columns=["inputs", "labels"])
        assert len(mine) == len(other)
        for key in (0, slice(None), [len(mine) - 1, 0]):
            a, b = mine[key], other[key]
            for name in ("inputs", "labels"):
                assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), (split, key, name)
        numpy_mine = ours[split].with_format("numpy", columns=["labels"])[:]["labels"]
        assert np.array_equal(numpy_mine, theirs[split].with_format("numpy", columns=["labels"])[:]["labels"])


def test_lesson_and_synthetic_data_are_array_tables():
    for dataset in ("synthetic", "lesson"):
        bundle = data.build(config.parse_config(["--dataset", dataset]))
        assert isinstance(bundle.train, ArrayTable) and isinstance(bundle.validation, ArrayTable)
        assert bundle.train[0]["inputs"].dtype == torch.float32 and bundle.train[0]["labels"].dtype == torch.int64
