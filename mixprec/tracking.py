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


def write_yaml(path: Path, data: dict) -> None:
    write_atomic(path, yaml.safe_dump(data, sort_keys=False))


def write_json(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps({k: _clean(v) for k, v in data.items()}, indent=2) + "\n")
