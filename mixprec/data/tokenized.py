"""Text classification for transformers models (`--dataset text_classification`): a CSV or JSON-lines
`--train_file` with a `text` column, an optional second text column `text_pair` (sentence pairs, as in GLUE
MRPC) and an integer `label` column, tokenized with the model's tokenizer (`--tokenizer_name`, else the
model's folder), padded and truncated to `--block_size` tokens. `inputs` are the token ids (padding is the
tokenizer's pad token, which the model masks out), `labels` the class. The last `val_fraction` of the rows is
validation. The labels are checked against the model's `num_labels` (mixprec.models.hf_flags passes it).

Or a dataset that `datasets.load_dataset` loads (`--dataset_name glue --dataset_config mrpc`: the Hub, or a
local folder of CSV/JSON/Parquet files): its validation split (else test, else a share of train); the text
columns are `text` (and `text_pair`), else GLUE's `sentence1` and `sentence2`, else `sentence`, or
`--dataset_args text_column=...,text_pair_column=...`; the label column is `label` (`label_column=...`).

A `--train_file` is read line by line before `datasets` parses it (which fails on a bad row with a traceback,
or guesses: a label beyond int64 becomes a float), so that a bad file is one line naming the line and the fix:
a folder, an empty file (a pipe: preflight.checked_exists), bytes that are not UTF-8 (a BOM, CRLF or CR line ends
are fine), a CSV header that names a column twice or has no rows, a row with more or fewer fields than the header,
a JSON line that is not an object, a JSON column of mixed kinds, a text that is empty or not text, a label that is
missing, a boolean, a decimal (regression is not supported) or a word (the words found are listed: class names
are not mapped to numbers). Then the classes, of a file or a --dataset_name: a negative label, class numbers far
apart (more unused numbers below the highest than classes found, and more than SPARE_CLASSES: 0, 1000000, 2000000
would take a head of 2,000,001 outputs), a label beyond the model's `num_labels`, a model of one label
(transformers' regression head) and training rows of one class (a classifier that cannot fail) are refused.
"""
from __future__ import annotations

import csv
import glob
import itertools
import json
import re
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..errors import explain
from ..typed_args import Setting, fraction, positive
from . import DataBundle, _args, _local_path, register
from .checks import deepest_message
from .text import tail_split

ARGS = {"tokenizer": Setting(None, str, optional=True), "block_size": positive(128), "num_labels": positive(2),
        "val_fraction": fraction(0.2), "text_column": Setting(None, str, optional=True),
        "text_pair_column": Setting(None, str, optional=True), "label_column": Setting("label", str)}
PAIRS = (("text", "text_pair"), ("sentence1", "sentence2"), ("sentence", None))  # the usual column names
INTEGER = re.compile(r"\s*[+-]?[0-9]+\s*")  # what pandas reads as an integer (not '١', not '1_000')
BOOLEANS = {"true", "false"}  # in any case: pandas reads True, TRUE, true as booleans
SPARE_CLASSES = 8  # unused class numbers allowed below the highest (or one per class found, if more)
SHOWN = 5  # values listed in a message
JSON_KINDS = ((bool, "bool"), (int, "int"), (float, "float"), (str, "text"), (list, "list"), (dict, "object"))


def _load_tokenizer(name: str | None):
    from transformers import AutoTokenizer

    from ..models.hf_folder import remote_code
    if not name:
        raise UsageError("--dataset text_classification tokenizes with a transformers model's tokenizer: add "
                         "--model_name_or_path or --config_name with --tokenizer_name")
    try:
        tok = AutoTokenizer.from_pretrained(name, **remote_code())
    except Exception as err:  # noqa: BLE001  (a broken folder, offline)
        raise UsageError(f"tokenizer '{name}' could not be loaded ({type(err).__name__}): check the folder") from None
    if tok.pad_token_id is None:
        raise UsageError(f"tokenizer '{name}' has no pad token, which classification batches need: save the "
                         f"tokenizer with one (tokenizer.pad_token = ...; save_pretrained)")
    return tok


def _names(names: list[str], a: dict, source: str) -> tuple[list[str], str]:
    """(the text column(s), the label column) among a table's column `names`: the ones named in --dataset_args,
    else the usual names; a missing one is refused."""
    text, pair = a["text_column"], a["text_pair_column"]
    if text is None:  # the usual names; a text_pair_column given alone is kept
        found, usual = next(((t, p if p in names else None) for t, p in PAIRS if t in names), ("text", None))
        text, pair = found, pair if pair is not None else usual
    for name in (text, a["label_column"], pair):
        if name is not None and name not in names:
            raise UsageError(f"{source} has no '{name}' column (it has {', '.join(names)}): give "
                             f"'text' (and optionally 'text_pair') and an integer 'label', or name them with "
                             f"--dataset_args text_column=...,label_column=...")
    return [text, *([pair] if pair else [])], a["label_column"]


def _columns(ds, a: dict, source: str) -> list[str]:
    """The text column(s) to tokenize and the label column of a loaded table, checked to be text and integers."""
    columns, label = _names(ds.column_names, a, source)
    kinds = {col: getattr(ds.features[col], "dtype", type(ds.features[col]).__name__) for col in (*columns, label)}
    for col in columns:
        if kinds[col] not in ("string", "large_string"):
            raise UsageError(f"{source}: column '{col}' is not text ({kinds[col]}): give text in it")
    for col in (*columns, label):
        empty = ds.data.column(col).null_count  # an empty field, or a split without the column
        if empty:
            raise UsageError(f"{source}: column '{col}' is empty in {empty} of {len(ds)} rows: fill them in or "
                             f"drop those rows")
    kind = kinds[label]
    if kind in ("string", "large_string"):
        found = ds.unique(label)
        listed = ", ".join(repr(v) for v in found[:SHOWN]) + (", ..." if len(found) > SHOWN else "")
        raise UsageError(f"{source}: column '{label}' holds words ({listed}), not class numbers: give class "
                         f"numbers 0, 1, ... (mapping class names to numbers is not supported)")
    if kind not in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32"):
        why = ("regression is not supported: " if str(kind).startswith("float") else
               "false is 0 and true 1: " if kind == "bool" else "")
        raise UsageError(f"{source}: column '{label}' is not integer ({kind}): {why}give class numbers 0, 1, ...")
    return columns


class _Values:
    """What one column of a file holds, row by row: per kind of value ('int', 'text', 'missing', 'float', ...)
    where it is first (a line), how many rows and a few distinct values; per integer where it is first (a label
    column's: `ints`)."""

    def __init__(self, ints: bool = True):
        self.kinds: dict[str, list] = {}
        self.ints: dict[int, str] | None = {} if ints else None

    def add(self, kind: str, where: str, value=None, count: int = 1) -> None:
        entry = self.kinds.setdefault(kind, [where, 0, []])
        entry[1] += count
        if value is not None and len(entry[2]) < SHOWN and value not in entry[2]:
            entry[2].append(value)
        if kind == "int" and self.ints is not None:
            self.ints.setdefault(value, where)


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


def _lines(path: Path, source: str):
    """(line number, text) of a UTF-8 file, line ends kept (LF, CRLF or CR), a leading BOM dropped."""
    number = 0
    try:
        with open(path, "rb") as f:
            for chunk in f:
                for raw in chunk.splitlines(keepends=True):
                    number += 1
                    try:
                        text = raw.decode("utf-8")
                    except UnicodeDecodeError as err:
                        raise UsageError(f"{source}: line {number} is not UTF-8 text (byte 0x{raw[err.start]:02x}): "
                                         f"save the file as UTF-8") from None
                    yield number, text.removeprefix("\ufeff") if number == 1 else text
    except OSError as err:
        raise explain(err, "--train_file", path) from None


def _scan_csv(path: Path, a: dict, source: str) -> tuple[dict[str, _Values], int]:
    """The text and label columns of a CSV file, and its number of rows; its shape checked row by row."""
    limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # a long text is fine (the default stops at 131072 characters)
    try:
        reader = csv.reader(text for _, text in _lines(path, source))
        rows = (row for row in reader if len(row) > 1 or "".join(row).strip())  # pandas skips blank lines too
        header = next(rows, None)
        if header is None:
            raise UsageError(f"{source} is empty: give a header line (text,label) and a row per example")
        twice = sorted({name for name in header if name and header.count(name) > 1})  # '': pandas' Unnamed
        if twice:
            raise UsageError(f"{source}: the header names the column '{twice[0]}' more than once: give every "
                             f"column its own name")
        texts, label = _names(header, a, source)
        values, count, at = {name: _Values() for name in (*texts, label)}, 0, header.index(label)
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


def _json_rows(path: Path, source: str):
    """(where, row) of a JSON-lines file, or of a file that is one JSON list (as `datasets` reads both)."""
    lines = _lines(path, source)
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


def _scan_json(path: Path, a: dict, source: str) -> tuple[dict[str, _Values], int]:
    """The text and label columns of a JSON-lines file, and its number of rows; each row checked to be an
    object (a row without a key has that column missing)."""
    values: dict[str, _Values] = {}
    rows, first = 0, None
    for where, row in _json_rows(path, source):
        if not isinstance(row, dict):
            raise UsageError(f"{source}: {where} is not a JSON object ({json.dumps(row)[:40]}): write one object "
                             f"per line, e.g. {{\"text\": \"...\", \"label\": 0}}")
        rows, first = rows + 1, first or where
        for key in values.keys() - row.keys():
            values[key].add("missing", where)
        for key, value in row.items():
            if key not in values:
                values[key] = _Values(ints=key == a["label_column"])
                if rows > 1:  # the rows before this one lack it
                    values[key].add("missing", first, count=rows - 1)
            values[key].add(*_json_kind(value, where))
    if not rows:
        raise UsageError(f"{source} has no rows: give one JSON object per line")
    texts, label = _names(list(values), a, source)
    plural = {"int": "numbers", "float": "numbers", "text": "text", "bool": "booleans", "list": "lists",
              "object": "objects"}
    for key in values.keys() - {*texts, label}:  # pyarrow refuses a column of mixed kinds, even one not used
        kinds = {plural[kind]: entry[0] for kind, entry in values[key].kinds.items() if kind != "missing"}
        if len(kinds) > 1:
            (one, at), (other, also) = sorted(kinds.items(), key=lambda kw: int(re.search("[0-9]+", kw[1])[0]))[:2]
            raise UsageError(f"{source}: column '{key}' holds {one} ({at}) and {other} ({also}): give one kind of "
                             f"value per column, or drop the column")
    return {name: values[name] for name in (*texts, label)}, rows


def _check_values(values: dict[str, _Values], label: str, rows: int, source: str) -> None:
    """Every row holds text in the text column(s) and an integer label: not a word (the words found are listed),
    a decimal, a boolean, a list or nothing."""
    named = {"int": "a number", "float": "a number", "bool": "a boolean", "list": "a list", "object": "an object"}
    as_label = {**named, "float": "a decimal number: regression is not supported",
                "bool": "a boolean (false is 0, true is 1)"}
    for name, column in values.items():
        kinds, want = column.kinds, ("class numbers 0, 1, ..." if name == label else "text")
        if name == label and "text" in kinds:
            where, _, found = kinds["text"]
            listed = ", ".join(repr(v) for v in found) + (", ..." if len(found) == SHOWN else "")
            raise UsageError(f"{source}: column '{label}' holds words, not class numbers ({listed}; the first on "
                             f"{where}): give {want} (mapping class names to numbers is not supported)")
        bad = next((kind for kind in kinds if kind not in ("missing", "int" if name == label else "text")), None)
        if bad:
            where, _, shown = kinds[bad]
            what = (as_label if name == label else named)[bad]
            raise UsageError(f"{source}: the {name} {shown[0]} on {where} is {what}: give {want}"
                             f"{' as integers' * (name == label)}")
        if "missing" in kinds:
            where, count, _ = kinds["missing"]
            raise UsageError(f"{source}: column '{name}' is empty on {where} ({count} of {rows} rows): fill in "
                             f"{want} or drop those rows")


def _check_classes(seen: dict[int, str], num_labels: int, source: str) -> None:
    """The class numbers found (each with where it is first) fit a classifier of `num_labels` outputs: from 0,
    below num_labels, and not so far apart that most outputs of the head would have no rows."""
    found = sorted(seen)
    low, high = found[0], found[-1]
    if low < 0:
        raise UsageError(f"{source} has the label {low} (on {seen[low]}), outside 0..{num_labels - 1}: class numbers "
                         f"start at 0: give 0..{num_labels - 1}")
    if high + 1 - len(found) > max(len(found), SPARE_CLASSES):
        listed = ", ".join(map(str, found[:SHOWN])) + (", ..." if len(found) > SHOWN else "")
        raise UsageError(f"{source} has {len(found)} classes numbered up to {high} ({listed}; {high} on "
                         f"{seen[high]}), which would take a classifier of {high + 1:,} outputs: number the "
                         f"classes 0..{len(found) - 1}")
    if high >= num_labels:
        raise UsageError(f"{source} has the label {high} (on {seen[high]}), outside 0..{num_labels - 1}: the model "
                         f"has {num_labels} classes (num_labels): give class numbers 0..{num_labels - 1}, or a "
                         f"model of {high + 1} classes (saved with num_labels={high + 1})")


def _labels(ds, label: str) -> np.ndarray:
    return np.asarray(ds.with_format("numpy", columns=[label])[:][label])


def _check_loaded_classes(parts, label: str, num_labels: int, source: str) -> None:
    """_check_classes on a loaded dataset's splits (a --dataset_name, which is not scanned line by line)."""
    seen: dict[int, str] = {}
    for name, part in parts.items():
        values, first = np.unique(_labels(part, label), return_index=True)
        for value, row in zip(values.tolist(), first.tolist()):
            seen.setdefault(value, f"row {row + 1} of its {name} split")
    if seen:
        _check_classes(seen, num_labels, source)


def _one_class(parts, label: str, source: str, file: bool) -> None:
    """Training rows of one class only make a classifier that cannot fail (val accuracy 1.0 on that class)."""
    train = np.unique(_labels(parts["train"], label))
    if len(train) != 1:
        return
    others = sorted(set(np.unique(_labels(parts["validation"], label)).tolist()) - set(train.tolist()))
    hint = (f"; the others ({', '.join(map(str, others[:SHOWN]))}) are only in the validation rows"
            f"{' (the last rows of the file): shuffle the file' if file else ''}" if others else
            ": add rows of the other classes")
    raise UsageError(f"{source}: every training row has the label {train[0]}: a classifier needs rows of two or "
                     f"more classes to learn anything{hint}")


def _local_file(cfg) -> tuple[Path, str]:
    """(--train_file, 'csv' or 'json'): a file named .csv or .json(l) (a pipe is refused by _local_path)."""
    path = _local_path(cfg, "a .csv or .jsonl file with 'text' and 'label' columns")
    if path.is_dir():
        raise UsageError(f"--train_file '{cfg.train_file}' is a folder: give a .csv or .jsonl file (a folder of CSV "
                         f"or JSON files loads with --dataset_name FOLDER)")
    kind = {".csv": "csv", ".json": "json", ".jsonl": "json"}.get(path.suffix.lower())
    if kind is None:
        raise UsageError(f"--train_file '{cfg.train_file}' must be .csv, .json or .jsonl")
    return path, kind


def _load_file(path: Path, kind: str, source: str):
    """The file (already scanned) as a `datasets` table: only an empty field is missing in a CSV (pandas would
    also read a text 'NA' or 'None' as missing); a parse error left is one line."""
    from datasets import load_dataset
    from datasets.utils import logging as datasets_logging

    options = {"keep_default_na": False, "na_values": [""]} if kind == "csv" else {}
    verbosity = datasets_logging.get_verbosity()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)  # its parsers log their errors before raising
    try:  # data_files is a glob pattern: escaped, so that '[1]' or '*' in the name are taken literally
        return load_dataset(kind, data_files=glob.escape(str(path)), split="train", **options)
    except Exception as err:  # noqa: BLE001  (pandas / pyarrow parse errors of every kind)
        raise UsageError(f"{source} could not be read as {kind.upper()} ({deepest_message(err)}): fix the "
                         f"file") from None
    finally:
        datasets_logging.set_verbosity(verbosity)


@register("text_classification", ARGS)
def text_classification(cfg) -> DataBundle:
    a = _args(cfg)
    if a["num_labels"] < 2:
        raise UsageError(f"the classifier has num_labels {a['num_labels']} (the model's config.json, or --dataset_args "
                         f"num_labels): one output is transformers' regression head, which is not supported: give "
                         f"a model of 2 or more classes")
    label = a["label_column"]
    if cfg.dataset_name:  # the Hub (or a local folder that load_dataset reads)
        if cfg.train_file:
            raise UsageError(f"--dataset_name {cfg.dataset_name} and --train_file {cfg.train_file}: give one")
        from .hub import load
        from .images import with_validation

        tok = _load_tokenizer(a["tokenizer"])
        parts = with_validation(load(cfg.dataset_name, cfg.dataset_config), a["val_fraction"])
        source = f"--dataset_name {cfg.dataset_name}"
    else:
        path, kind = _local_file(cfg)
        source = f"--train_file '{cfg.train_file}'"
        values, rows = (_scan_csv if kind == "csv" else _scan_json)(path, a, source)
        _check_values(values, label, rows, source)
        _check_classes(values[label].ints, a["num_labels"], source)
        tok = _load_tokenizer(a["tokenizer"])
        parts = tail_split(_load_file(path, kind, source), a["val_fraction"])
    columns = _columns(parts["train"], a, source)
    for name in set(parts) - {"train"}:  # a Hub dataset's validation split may differ from its train split
        _columns(parts[name], a, f"{source} ({name} split)")
    if cfg.dataset_name:
        _check_loaded_classes(parts, label, a["num_labels"], source)
    _one_class(parts, label, source, file=not cfg.dataset_name)
    block = a["block_size"]

    def encode(batch):
        enc = tok(*[batch[c] for c in columns], truncation=True, max_length=block, padding="max_length")
        return {"inputs": np.asarray(enc["input_ids"], dtype=np.int64), "labels": batch[label]}

    mapped = {k: v.map(encode, batched=True, remove_columns=v.column_names, desc=f"tokens ({k})")
              for k, v in parts.items()}
    info = {"task": "classification", "num_classes": a["num_labels"], "vocab_size": len(tok),
            "block_size": block, "pad_token_id": tok.pad_token_id, "tokenizer": a["tokenizer"]}
    return DataBundle(mapped["train"], mapped["validation"], info)
