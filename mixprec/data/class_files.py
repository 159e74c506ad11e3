"""Text-classification files (`--train_file`, `--validation_file` of `--dataset text_classification`), read line
by line before `datasets` parses them (which fails on a bad row with a traceback, or guesses: a label beyond int64
becomes a float), so that a bad file is one line naming the file, the line and the fix: a folder, an empty file (a
pipe: preflight.checked_exists), bytes that are not UTF-8 (a BOM, CRLF or CR line ends are fine), a CSV header
that names a column twice or has no rows, a row with more or fewer fields than the header, a JSON line that is not
an object, a JSON column of mixed kinds, a text that is empty or not text, a label that is missing, a boolean, a
decimal (regression is not supported), or words mixed with class numbers. A label column holds class numbers or
class names (words, mapped to numbers by mixprec.data.tokenized); `Values.classes` has each one found, with where
it is first.
"""
from __future__ import annotations

import csv
import itertools
import json
import re
from pathlib import Path

import numpy as np

from ..errors import UsageError
from .checks import utf8_lines

PAIRS = (("text", "text_pair"), ("sentence1", "sentence2"), ("sentence", None))  # the usual column names
INTEGER = re.compile(r"\s*[+-]?[0-9]+\s*")  # what pandas reads as an integer (not '١', not '1_000')
BOOLEANS = {"true", "false"}  # in any case: pandas reads True, TRUE, true as booleans
SHOWN = 5  # values listed in a message
JSON_KINDS = ((bool, "bool"), (int, "int"), (float, "float"), (str, "text"), (list, "list"), (dict, "object"))
SUFFIXES = {".csv": "csv", ".json": "json", ".jsonl": "json"}


def file_kind(path: Path, flag: str, given: str) -> str:
    """'csv' or 'json' for a file named .csv, .json or .jsonl (`flag` the option that names it)."""
    if path.is_dir():
        raise UsageError(f"{flag} '{given}' is a folder: give a .csv or .jsonl file (a folder of CSV or JSON files "
                         f"loads with --dataset_name FOLDER)")
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise UsageError(f"{flag} '{given}' must be .csv, .json or .jsonl")
    return kind


def scan(path: Path, kind: str, a: dict, source: str, flag: str) -> dict[str, "Values"]:
    """The text and label columns of a file, every row checked (see the module docstring)."""
    values, rows = (scan_csv if kind == "csv" else scan_json)(path, a, source, flag)
    check_values(values, a["label_column"], rows, source)
    return values


def names(columns: list[str], a: dict, source: str) -> tuple[list[str], str]:
    """(the text column(s), the label column) among a table's `columns`: the ones named in --dataset_args, else
    the usual names; a missing one is refused."""
    text, pair = a["text_column"], a["text_pair_column"]
    if text is None:  # the usual names; a text_pair_column given alone is kept
        found, usual = next(((t, p if p in columns else None) for t, p in PAIRS if t in columns), ("text", None))
        text, pair = found, pair if pair is not None else usual
    for name in (text, a["label_column"], pair):
        if name is not None and name not in columns:
            raise UsageError(f"{source} has no '{name}' column (it has {', '.join(columns)}): give "
                             f"'text' (and optionally 'text_pair') and a 'label' (class numbers or names), or name "
                             f"them with --dataset_args text_column=...,label_column=...")
    return [text, *([pair] if pair else [])], a["label_column"]


class Values:
    """What one column of a file holds, row by row: per kind of value ('int', 'text', 'missing', 'float', ...)
    where it is first (a line), how many rows and a few distinct values; for a label column, per class (a number
    or a name) where it is first (`classes`)."""

    def __init__(self, label: bool = True):
        self.kinds: dict[str, list] = {}
        self.classes: dict[int | str, str] | None = {} if label else None

    def add(self, kind: str, where: str, value=None, count: int = 1) -> None:
        entry = self.kinds.setdefault(kind, [where, 0, []])
        entry[1] += count
        if value is not None and len(entry[2]) < SHOWN and value not in entry[2]:
            entry[2].append(value)
        if kind in ("int", "text") and value is not None and self.classes is not None:
            self.classes.setdefault(value, where)


def _csv_kind(raw: str, where: str) -> tuple[str, str, object]:
    """A CSV label field as (kind, where, value), as pandas would read it (an empty field is missing)."""
    if INTEGER.fullmatch(raw):
        return "int", where, int(raw)
    if raw.strip().lower() in BOOLEANS:
        return "bool", where, raw.strip()
    try:
        number = float(raw)
    except ValueError:
        return ("text", where, raw) if raw.strip() else ("missing", where, None)
    return ("float", where, raw.strip()) if np.isfinite(number) else ("missing", where, None)  # 'nan': empty


def _json_kind(value, where: str) -> tuple[str, str, object]:
    """A JSON value as (kind, where, value shown): JSON's true is a boolean, not the class 1; NaN is missing."""
    kind = next((k for t, k in JSON_KINDS if isinstance(value, t)), "missing")
    kind = "missing" if kind == "float" and not np.isfinite(value) else kind
    return kind, where, value if kind in ("int", "text") else None if kind == "missing" else json.dumps(value)[:40]


def scan_csv(path: Path, a: dict, source: str, flag: str) -> tuple[dict[str, Values], int]:
    """The text and label columns of a CSV file, and its number of rows; its shape checked row by row."""
    limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # a long text is fine (the default stops at 131072 characters)
    try:
        reader = csv.reader(text for _, text in utf8_lines(path, source, flag))
        rows = (row for row in reader if len(row) > 1 or "".join(row).strip())  # pandas skips blank lines too
        header = next(rows, None)
        if header is None:
            raise UsageError(f"{source} is empty: give a header line (text,label) and a row per example")
        twice = sorted({name for name in header if name and header.count(name) > 1})  # '': pandas' Unnamed
        if twice:
            raise UsageError(f"{source}: the header names the column '{twice[0]}' more than once: give every "
                             f"column its own name")
        texts, label = names(header, a, source)
        values = {name: Values(label=name == label) for name in (*texts, label)}
        count, at = 0, header.index(label)
        for row in rows:
            count, where = count + 1, f"line {reader.line_num}"
            if len(row) != len(header):
                raise UsageError(f"{source}: the row ending on {where} has {len(row)} field{'s' * (len(row) != 1)}, "
                                 f"the header {len(header)} ({','.join(header)}): quote a field that holds a comma "
                                 f"(\"a, b\"), close every quote, or fix the row")
            for name in texts:
                values[name].add("text" if row[header.index(name)] else "missing", where)
            values[label].add(*_csv_kind(row[at], where))
    except csv.Error as err:
        raise UsageError(f"{source} is not CSV that can be read ({err}): fix the file") from None
    finally:
        csv.field_size_limit(limit)
    if not count:
        raise UsageError(f"{source} has a header but no rows: give a row per example")
    return values, count


def _json_rows(path: Path, source: str, flag: str):
    """(where, row) of a JSON-lines file, or of a file that is one JSON list (as `datasets` reads both)."""
    lines = utf8_lines(path, source, flag)
    first = next(((n, text) for n, text in lines if text.strip()), None)
    if first is None:
        raise UsageError(f"{source} is empty: give one JSON object per line, e.g. {{\"text\": \"...\", \"label\": 0}}")
    if first[1].lstrip().startswith("["):
        try:
            items = json.loads(first[1] + "".join(text for _, text in lines))
        except ValueError as err:
            raise UsageError(f"{source} is not valid JSON ({err.msg}, line {first[0] + err.lineno - 1}): give a "
                             f"JSON list of objects, or one JSON object per line") from None
        items = items if isinstance(items, list) else [items]
        yield from ((f"item {i} of its list", row) for i, row in enumerate(items, 1))
        return
    for number, text in itertools.chain([first], lines):
        if text.strip():
            try:
                yield f"line {number}", json.loads(text)
            except ValueError as err:
                raise UsageError(f"{source}: line {number} is not JSON ({err.msg}): write one JSON object per "
                                 f"line, e.g. {{\"text\": \"...\", \"label\": 0}}") from None


def scan_json(path: Path, a: dict, source: str, flag: str) -> tuple[dict[str, Values], int]:
    """The text and label columns of a JSON-lines file, and its number of rows; each row checked to be an
    object (a row without a key has that column missing)."""
    values: dict[str, Values] = {}
    rows, first = 0, None
    for where, row in _json_rows(path, source, flag):
        if not isinstance(row, dict):
            raise UsageError(f"{source}: {where} is not a JSON object ({json.dumps(row)[:40]}): write one object "
                             f"per line, e.g. {{\"text\": \"...\", \"label\": 0}}")
        rows, first = rows + 1, first or where
        for key in values.keys() - row.keys():
            values[key].add("missing", where)
        for key, value in row.items():
            if key not in values:
                values[key] = Values(label=key == a["label_column"])
                if rows > 1:  # the rows before this one lack it
                    values[key].add("missing", first, count=rows - 1)
            values[key].add(*_json_kind(value, where))
    if not rows:
        raise UsageError(f"{source} has no rows: give one JSON object per line")
    texts, label = names(list(values), a, source)
    plural = {"int": "numbers", "float": "numbers", "text": "text", "bool": "booleans", "list": "lists",
              "object": "objects"}
    for key in values.keys() - {*texts, label}:  # pyarrow refuses a column of mixed kinds, even one not used
        kinds = {plural[kind]: entry[0] for kind, entry in values[key].kinds.items() if kind != "missing"}
        if len(kinds) > 1:
            (one, at), (other, also) = sorted(kinds.items(), key=lambda kw: int(re.search("[0-9]+", kw[1])[0]))[:2]
            raise UsageError(f"{source}: column '{key}' holds {one} ({at}) and {other} ({also}): give one kind of "
                             f"value per column, or drop the column")
    return {name: values[name] for name in (*texts, label)}, rows


def check_values(values: dict[str, Values], label: str, rows: int, source: str) -> None:
    """Every row holds text in the text column(s) and a label that is a class number or a class name (not both in
    one column), not a decimal, a boolean, a list or nothing."""
    named = {"int": "a number", "float": "a number", "bool": "a boolean", "list": "a list", "object": "an object"}
    as_label = {**named, "float": "a decimal number: regression is not supported",
                "bool": "a boolean (false is 0, true is 1)"}
    for name, column in values.items():
        kinds, want = column.kinds, ("class numbers 0, 1, ... or class names" if name == label else "text")
        if name == label and "text" in kinds and "int" in kinds:
            (where, _, found), (at, _, numbers) = kinds["text"], kinds["int"]
            listed = ", ".join(repr(v) for v in found) + (", ..." if len(found) == SHOWN else "")
            raise UsageError(f"{source}: column '{label}' holds words ({listed}; the first on {where}) and class "
                             f"numbers ({numbers[0]} on {at}): give one kind, a class name in every row or a class "
                             f"number in every row")
        bad = next((kind for kind in kinds if kind not in ("missing", *(("int", "text") if name == label else
                                                                        ("text",)))), None)
        if bad:
            where, _, shown = kinds[bad]
            what = (as_label if name == label else named)[bad]
            raise UsageError(f"{source}: the {name} {shown[0]} on {where} is {what}: give {want}")
        if "missing" in kinds:
            where, count, _ = kinds["missing"]
            raise UsageError(f"{source}: column '{name}' is empty on {where} ({count} of {rows} rows): fill in "
                             f"{want} or drop those rows")
