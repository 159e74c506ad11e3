"""Shared helpers: run the recipe for real (a subprocess through `accelerate launch` or python) and read
what it wrote."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mixprec.metrics import TIMING_FIELDS

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "recipes" / "train.py"
CPU_CONFIG = REPO / "accelerate_configs" / "cpu.yaml"


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    out: Path | None

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines() if line]

    def comparable(self) -> list[dict]:
        """metrics.jsonl without the fields that measure time or memory, which differ between any two runs."""
        return without_timings(self.metrics())

    def train_records(self) -> list[dict]:
        return [r for r in self.metrics() if "loss" in r]

    def eval_records(self) -> list[dict]:
        return [r for r in self.metrics() if "val_loss" in r]

    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    def config(self) -> dict:
        import yaml
        return yaml.safe_load((self.out / "config.yaml").read_text())


def without_timings(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records]


def base_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "MIXPREC_"))}
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra or {})
    return env


def free_port() -> int:
    """A TCP port nobody listens on now: multi-process runs must not share a fixed one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_recipe(*args, out: Path | None = None, launcher: str = "accelerate", script: Path = TRAIN,
               env: dict | None = None, cwd: Path | None = None, timeout: int = 900, check: bool = True,
               config: Path = CPU_CONFIG, launch_args: tuple = ()) -> Run:
    """Run a recipe in a subprocess. `launcher`: 'accelerate' (accelerate launch with `config`, the CPU
    config by default, and `launch_args`) or 'python'. With `check`, a non-zero exit fails the test and
    shows the output."""
    cmd = (["accelerate", "launch", "--config_file", str(config), *map(str, launch_args)] if launcher == "accelerate"
           else [sys.executable])
    cmd += [str(script), *map(str, args)]
    if out is not None:
        cmd += ["--output_dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=base_env(env), cwd=cwd or REPO, timeout=timeout)
    run = Run(proc.returncode, proc.stdout, proc.stderr, out)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\n"
                    f"STDERR:\n{proc.stderr[-4000:]}")
    return run


def snapshot(root: Path) -> dict[str, str]:
    """Path -> sha256 of every file under root: equal snapshots mean nothing was touched."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; reset them around in-process tests."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA GPU: skipped elsewhere, with the reason."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run scripts/gpu_checks.sh on a machine with one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
