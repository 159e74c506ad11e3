"""The default command trains before it imports what it does not need to train: `datasets` never (the synthetic
data are numpy arrays: mixprec.data.arrays, the same rows as `datasets` would give), DeepSpeed only when the run is
finished (Accelerate's `save_model`), matplotlib never: metrics.png is drawn by a helper process that imported it
while the run trained (mixprec.tracking.plot_process), the same picture as the run's own drawing, and the run
draws it itself where the helper cannot. docs/performance.md, "Start-up beyond Accelerate's own", says what each
costs; benchmarks/startup.py measures the whole."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from datasets import Dataset

from helpers import HOOKS, TRAIN, live_processes, run_in_process
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
    assert "matplotlib" not in first, first.get("matplotlib")  # the helper process draws metrics.png
    stack = first.get("deepspeed", ["training/run.py:finish"])  # if at all (DeepSpeed may not be installed)
    assert any(frame.endswith("training/run.py:finish") for frame in stack), stack


def _helpers() -> list[int]:
    """This test process's helper children (another worker's runs start their own)."""
    return [pid for pid, cmdline, _ in live_processes(parent=os.getpid()) if "mixprec.tracking.plot_process" in cmdline]


def test_the_helper_draws_the_same_picture_and_ends_with_the_run_and_the_run_draws_where_it_cannot(
        tmp_path, capsys, monkeypatch):
    from mixprec.tracking import plot_process, plots

    started, real_init = [], plot_process.PlotProcess.__init__

    def counted(self):  # the real helper, counted
        real_init(self)
        started.append(self.proc is not None)

    monkeypatch.setattr(plot_process.PlotProcess, "__init__", counted)
    args = ["--max_steps", "4", "--log_every", "2", "--mixed_precision", "no"]
    run = run_in_process([*args, "--output_dir", tmp_path / "m"], capsys)  # this process has matplotlib imported:
    assert run.returncode == 0 and started == []  # the run draws itself, no helper (PlotProcess.worth_starting)

    monkeypatch.setattr(plot_process.PlotProcess, "worth_starting", staticmethod(lambda: True))  # as a fresh one
    before = set(_helpers())
    run = run_in_process([*args, "--output_dir", tmp_path / "a"], capsys)
    assert run.returncode == 0 and f"curves: {tmp_path / 'a' / 'metrics.png'}" in run.stdout
    assert started == [True]  # the helper started and drew
    assert set(_helpers()) <= before  # the run's helper ended with it
    plots.plot_run(tmp_path / "a", tmp_path / "here.png")  # the same records drawn in this process
    assert (tmp_path / "a" / "metrics.png").read_bytes() == (tmp_path / "here.png").read_bytes()

    refused = run_in_process([*args, "--fp32_modules", "no.such", "--output_dir", tmp_path / "c"], capsys)  # refused mid-start
    assert refused.returncode == 2 and set(_helpers()) <= before  # the helper started early ended with it

    monkeypatch.setattr(plot_process.sys, "executable", str(tmp_path / "no-python"))  # the helper cannot start
    run = run_in_process([*args, "--output_dir", tmp_path / "b"], capsys)
    assert run.returncode == 0 and f"curves: {tmp_path / 'b' / 'metrics.png'}" in run.stdout
    assert (tmp_path / "b" / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_process_with_matplotlib_imported_starts_no_helper():
    probe = ("import sys; from mixprec.tracking.plot_process import PlotProcess as P; fresh = P.worth_starting(); "
             "import matplotlib.figure; print(fresh, P.worth_starting(), 'matplotlib' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["True", "False", "True"], proc.stderr[-2000:]


def test_the_helper_answers_a_failure_as_the_run_would_meet_it(tmp_path):
    import errno

    from mixprec.tracking import plots
    from mixprec.tracking.plot_process import PlotProcess, error_of

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (tmp_path / "metrics.png").mkdir()  # the picture cannot replace a folder
    helper = PlotProcess()
    helper.request(tmp_path)
    answer = helper.result()
    assert answer["type"] == "IsADirectoryError" and answer["errno"] == errno.EISDIR
    err = error_of(answer)
    with pytest.raises(OSError) as here:  # what the run's own drawing meets
        plots.plot_run(tmp_path)
    assert isinstance(err, OSError) and (err.errno, err.strerror, err.filename) == (
        here.value.errno, here.value.strerror, here.value.filename)
    assert helper.proc is None and not (tmp_path / ".metrics.png.tmp").exists()


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
