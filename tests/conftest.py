"""Fixtures, the `gpu` marker's skip, and the groups that keep tests together on one pytest-xdist worker.
Shared helpers are in tests/helpers.py.

The suite runs on 2 pytest-xdist workers (pyproject.toml: `-n 2`): a recipe launch keeps one core busy
for most of its start-up, so two at a time use the second core. Tests that share a module-scoped run, or
that depend on the order of the tests before them (tests/test_docs.py), stay together on one worker; the
matrix's cells are grouped by model and precision, whose one-process run every engine is compared with.
`pytest -n 0` runs everything in one process.
"""
from __future__ import annotations

import os
import signal
import subprocess

import pytest

# Modules whose tests share module-scoped runs (or, test_docs, run README commands in order in the repository).
TOGETHER = {"test_bad_input", "test_data_sources", "test_deepspeed", "test_diagnosis", "test_docs",
            "test_generated_input", "test_health", "test_multiprocess", "test_nothing_lost", "test_precision_report",
            "test_run_folder", "test_scale_runs", "test_slurm", "test_train", "test_world_size"}


@pytest.fixture(autouse=True)
def environment_restored():
    """What a test's in-process code puts into os.environ (the recipes set OMP_WAIT_POLICY when imported,
    Accelerate sets its variables) does not reach the processes of the tests after it on the same worker."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; reset them around in-process tests."""
    from helpers import reset_accelerate

    reset_accelerate()
    yield
    reset_accelerate()


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs of our own (root only): a real filesystem that fills up or turns read-only."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}): needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def group(nodeid: str) -> str:
    """The tests one worker runs together: a module in TOGETHER, a matrix model x precision, else one test."""
    module = nodeid.split("::", 1)[0].rpartition("/")[2].removesuffix(".py")
    if module == "test_matrix" and "[" in nodeid:
        parts = nodeid.rsplit("[", 1)[1].rstrip("]").split("-")  # model-engine-precision
        return f"matrix-{parts[0]}-{parts[-1]}"
    return module if module in TOGETHER else nodeid


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scope scheduling with this suite's groups (`group`). (Its `loadgroup` marks do not group
    under pytest 9.2: xdist 3.8 renames items through a field pytest no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group(nodeid)

    return Groups(config, log)


def pytest_configure(config):
    """SIGINT stops the suite even when pytest was started with SIGINT ignored (in the background of a script:
    `pytest &`, nohup): otherwise the ignore passes to its workers, which then cannot stop the test they run
    when pytest ends, and to every launcher the tests start (a SIGINT sent to one would do nothing).
    Under `nohup pytest`, SIGHUP is ignored the same way: pytest and its workers still outlive a hangup (a handler
    that does nothing; the workers are told through OUTLIVE_HANGUP, since a handler, unlike an ignore, is not
    inherited), and so the launchers the tests start and send SIGHUP to end as they would anywhere else
    (tests/test_preemption.py, tests/test_compat.py; the tests' processes get no MIXPREC_ variable: base_env)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN or os.environ.get(OUTLIVE_HANGUP):
        os.environ[OUTLIVE_HANGUP] = "1"  # for the workers, started after this
        signal.signal(signal.SIGHUP, _hangup_outlived)


OUTLIVE_HANGUP = "MIXPREC_TEST_OUTLIVE_HANGUP"


def _hangup_outlived(signum, frame) -> None:
    """SIGHUP under `nohup pytest`: nothing (see pytest_configure)."""


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA GPU: skipped elsewhere, with the reason."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu_checks.sh on a machine with one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
