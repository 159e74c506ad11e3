"""benchmarks/trl_peer.py at a tiny size: the recipe and TRL's SFTTrainer on the same chat rows in the same
batches give the same fp32 loss curve (within the benchmark's stated tolerance), the same learning rates, and the
same token masks. TRL is not a dependency of mixprec: it runs in a Python of its own, found through
MIXPREC_TRL_PYTHON (else /tmp/trl-venv/bin/python); without one the test is skipped, saying so. No timing is
asserted."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from helpers import REPO
from test_hf_models import offline  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow
SCRIPT = REPO / "benchmarks" / "trl_peer.py"
REPORT = REPO / "benchmarks" / "trl_peer_report.py"


def trl_python() -> str:
    path = os.environ.get("MIXPREC_TRL_PYTHON", "/tmp/trl-venv/bin/python")
    if not os.path.exists(path):
        pytest.skip(f"no TRL environment: {path} does not exist (set MIXPREC_TRL_PYTHON to a Python with trl)")
    found = subprocess.run([path, "-c", "import trl"], capture_output=True, text=True)
    if found.returncode:
        pytest.skip(f"no TRL environment: {path} cannot import trl (set MIXPREC_TRL_PYTHON to a Python with trl)")
    return path


def tolerance() -> dict:
    spec = importlib.util.spec_from_file_location("trl_peer_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TOLERANCE


def test_the_recipe_and_sft_trainer_give_the_same_fp32_curve(offline, tmp_path):
    python = trl_python()
    out = tmp_path / "peer"
    # 48 rows, 4 x 2 accumulated: 6 windows of 8, the whole epoch in 6 steps; every step token-weighted over two
    # micro-batches holding different numbers of target tokens
    done = subprocess.run([sys.executable, str(SCRIPT), "--steps", "6", "--warmup", "2", "--repeats", "1",
                           "--precisions", "fp32", "--rows", "48", "--batch_size", "4",
                           "--gradient_accumulation_steps", "2", "--out", str(out), "--trl_python", python],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((out / "trl_peer.json").read_text())
    assert report["complete"]
    assert report["masks"] == {"rows_checked": 48, "rows_differing": 0, "first_differing": [],
                               "targets_checked": report["masks"]["targets_checked"]}
    (entry,) = report["rounds"]
    recipe, trl = entry["recipe"], entry["trl"]
    assert len(recipe["loss"]) == len(trl["loss"]) == 6 and recipe["loss"][-1] < recipe["loss"][0]
    assert trl["summary"]["sampling"] == "sequential" and trl["summary"]["threads"] >= 1
    assert trl["summary"]["activation_checkpointing"] is False  # SFTConfig's default is on; the recipe's off
    summary = report["summary"]["fp32"]
    assert summary["max_rel"] <= tolerance()["fp32"] == summary["tolerance_rel"], summary
    assert summary["lr_max_rel"] < 1e-12 and summary["grad_norm_max_rel"] < 1e-4
    # the micro-batches differ in target tokens, so a mean of the micro-batches' means would be another loss
    tokens = [json.loads(line) for line in (out / "runs" / "trl-fp32-r1" / "tokens.jsonl").read_text().splitlines()]
    counts = [sum(x != -100 for x in row["labels"]) for row in tokens]
    assert len({sum(counts[i:i + 4]) for i in range(0, 48, 4)}) > 1
    md = (out / "trl_peer.md").read_text()
    assert "| fp32 |" in md and "(met)" in md and "python benchmarks/trl_peer.py" in md
