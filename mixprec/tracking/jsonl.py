"""metrics.jsonl's values: JSON has no NaN or Inf, so they are written as the strings 'nan', 'inf' and '-inf'
(`clean`), which any JSON reader parses, and read back as floats (`unclean`, `read_records`)."""
from __future__ import annotations

import json
import math
from pathlib import Path


def clean(value):
    """NaN/Inf as strings, so that every line parses with any JSON reader."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def unclean(value):
    """The inverse of `clean`: 'nan', 'inf', '-inf' read back as floats."""
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf"):
        return float(value)
    return value


def read_lines(path: Path) -> tuple[list[str], int]:
    """The lines of a metrics.jsonl that are UTF-8 text, and how many are not (bytes a crash or a disk left)."""
    lines, unreadable = [], 0
    for raw in Path(path).read_bytes().splitlines():
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            unreadable += 1
    return lines, unreadable


def read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; 'nan'/'inf' strings back to floats, a line cut short or unreadable
    skipped."""
    records = []
    for line in read_lines(path)[0]:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append({k: unclean(v) for k, v in record.items()})
    return records
