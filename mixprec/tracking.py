"""The run's record: metrics.jsonl (one JSON object per logged step or evaluation), config.yaml, summary.json."""
from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from .checkpointing import write_atomic


def _clean(value):
    """JSON has no NaN/Inf: write them as strings so every line parses with any JSON reader."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLog:
    """Appends records to metrics.jsonl on the main process. On resume, records after the checkpoint's
    step (written by the run that crashed) are dropped first, so the file reads like one run."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None = None):
        self.path, self.enabled, self.file = path, enabled, None
        if not enabled:
            return
        kept = []
        if resume_step is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= resume_step:
                        kept.append(line)
                except (ValueError, KeyError):
                    continue  # a line cut short by the crash
        write_atomic(path, "".join(line + "\n" for line in kept))
        self.file = open(path, "a")

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


class Recorder:
    """Where the loop sends what it measures: metrics.jsonl now, trackers (W&B, TensorBoard) later.
    Only the global main process writes."""

    def __init__(self, out: Path, accelerator, resume_step: int | None = None):
        self.out, self.accelerator = out, accelerator
        self.jsonl = MetricsLog(out / "metrics.jsonl", accelerator.is_main_process, resume_step)

    def log(self, record: dict) -> None:
        """One optimizer step's metrics, one evaluation, or one health event (all carry `step`)."""
        self.jsonl.write(record)

    def checkpoint_state(self) -> dict:
        """What a checkpoint must remember for the record to continue after a resume."""
        return {}

    def finish(self, summary: dict) -> None:
        self.jsonl.close()
        if self.accelerator.is_main_process:
            write_json(self.out / "summary.json", summary)


def write_yaml(path: Path, data: dict) -> None:
    write_atomic(path, yaml.safe_dump(data, sort_keys=False))


def write_json(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps({k: _clean(v) for k, v in data.items()}, indent=2) + "\n")
