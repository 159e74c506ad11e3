"""Fixtures, and the `gpu` marker's skip. Shared helpers are in tests/helpers.py."""
from __future__ import annotations

import pytest


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; reset them around in-process tests."""
    from helpers import reset_accelerate

    reset_accelerate()
    yield
    reset_accelerate()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA GPU: skipped elsewhere, with the reason."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu_checks.sh on a machine with one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
