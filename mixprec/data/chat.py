"""Chat and prompt/completion data for transformers causal LMs (`--dataset chat`), in TRL's SFT formats.

Where from: `--train_file` a JSON-lines, JSON (one list of objects) or Parquet file, or a CSV of plain
prompt/completion text; or `--dataset_name` (anything `datasets.load_dataset` reads: a Hub id, a local folder)
with `--dataset_config`. Validation: `--validation_file` in the same form, else the dataset's own validation
split (validation, valid, val, else test), else a seeded `val_fraction` share of the training rows (10% by
default; the seed is fixed, so --seed does not move rows between the splits). The banner's validation line says
which.

The format comes from the columns, as TRL tells it: 'prompt' and 'completion' (both text, or both lists of
{role, content} messages: TRL looks at 'prompt' first, so a table with 'messages' too is read as prompt/completion),
else 'messages' (a list of {role, content}); anything else is one line naming the columns found and the formats.
A file is read in Python before `datasets` sees it, so that a bad row is one line naming the file, the line and
the fix (not JSON, not an object, a missing column, a message without a text 'content', ...); Parquet and
`--dataset_name` rows are checked as they are tokenized (row N).

How rows become tokens, targets and padded blocks: mixprec.data.chat_render. The tokenizer is the model's
(mixprec.models.hf_flags passes it and `--block_size`); the loss is on the assistant's tokens
(--assistant_only_loss, 'messages') or the completion's (--completion_only_loss, prompt/completion), both on by
default. Rows left without a target token within the block are dropped and counted in one line on the console;
none left is one line. `info["variable_targets"]` tells the training loop that rows have different numbers of
target tokens (the loss is weighted by them).
"""
from __future__ import annotations

import csv
import itertools
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from datasets import Dataset

from ..errors import UsageError
from ..typed_args import Setting, fraction, positive
from . import DataBundle, _args, _local_path, register, validation_path
from .chat_render import Renderer, check_template
from .checks import splittable, utf8_lines
from .text import HFTokenizer, hf_flag

if TYPE_CHECKING:
    from ..config.sections import DataSettings, ModelSettings

ARGS = {"tokenizer": Setting(None, str, optional=True), "block_size": positive(None, optional=True),
        "val_fraction": fraction(0.1)}
KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
SPLITS = ("validation", "valid", "val", "test")
SEED = 1234
FORMATS = ("'messages' (a list of {\"role\", \"content\"} messages), or 'prompt' and 'completion' (both text, "
           "or both lists of messages)")
EXAMPLE = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'
JSON_KINDS = ((bool, "a boolean"), (int, "a number"), (float, "a number"), (str, "text"), (list, "a list"),
              (dict, "an object"), (type(None), "null"))


def _kind(value) -> str:
    return next((name for typ, name in JSON_KINDS if isinstance(value, typ)), type(value).__name__)


def detect(columns: list[str], first: dict, source: str) -> str:
    """'messages', 'prompt_completion' (text) or 'prompt_completion_messages', from the columns (and the first
    row's prompt: text or a list)."""
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion_messages" if isinstance(first.get("prompt"), list) else "prompt_completion"
    if "messages" in columns:
        return "messages"
    found = ", ".join(repr(c) for c in columns) or "none"
    raise UsageError(f"{source} has the columns {found}, none of TRL's SFT formats: give {FORMATS}; plain text "
                     f"trains with --dataset text or --dataset hub")


def _messages(value, key: str, where: str, source: str) -> None:
    if not isinstance(value, list) or not value:
        raise UsageError(f"{source}: {where}: '{key}' is {'an empty list' if value == [] else _kind(value)}: give a "
                         f"list of messages, e.g. {EXAMPLE}")
    for j, message in enumerate(value, 1):
        ok = isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)
        if not ok:
            shown = json.dumps(message, default=str)[:60]
            raise UsageError(f"{source}: {where}: message {j} of '{key}' ({shown}) needs a text 'role' and a text "
                             f"'content': give messages such as {{\"role\": \"user\", \"content\": \"...\"}}")


def check_row(row: dict, fmt: str, where: str, source: str) -> None:
    """One row holds the format's columns, each of the right kind: one line naming the row and the fix."""
    keys = ("messages",) if fmt == "messages" else ("prompt", "completion")
    for key in keys:
        if key not in row:
            raise UsageError(f"{source}: {where} has no '{key}' (it has {', '.join(row) or 'nothing'}): give every "
                             f"row the same columns, {' and '.join(repr(k) for k in keys)}")
        if fmt == "prompt_completion":
            if not isinstance(row[key], str):
                raise UsageError(f"{source}: {where}: '{key}' is {_kind(row[key])}, not text: give text in every row "
                                 f"(or lists of messages in both 'prompt' and 'completion' of every row)")
        else:
            _messages(row[key], key, where, source)


def _parquet(path: Path, source: str) -> Dataset:
    """A Parquet file through `datasets` (memory-mapped and cached, so that tokenizing it is cached too)."""
    import glob

    from datasets import load_dataset
    from datasets.utils import logging as datasets_logging

    from .checks import deepest_message

    verbosity = datasets_logging.get_verbosity()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)  # its parsers log their errors before raising
    try:  # data_files is a glob pattern: escaped, so that '[1]' or '*' in the name are taken literally
        return load_dataset("parquet", data_files=glob.escape(str(path)), split="train")
    except Exception as err:  # noqa: BLE001  (pyarrow's errors of every kind)
        raise UsageError(f"{source} could not be read as Parquet ({deepest_message(err)}): fix or rewrite the "
                         f"file") from None
    finally:
        datasets_logging.set_verbosity(verbosity)


def _json_rows(path: Path, source: str) -> tuple[list[dict], list[str]]:
    """The rows of a JSON-lines file or of a file holding one JSON list, and where each is ('line 3')."""
    numbered = [(n, text) for n, text in utf8_lines(path, source, source.split()[0]) if text.strip()]
    if not numbered:
        raise UsageError(f"{source} is empty: give one JSON object per line, e.g. {EXAMPLE}")
    if numbered[0][1].lstrip().startswith("["):
        try:
            items = json.loads("".join(text for _, text in numbered))
        except ValueError as err:
            raise UsageError(f"{source} is not valid JSON ({err.msg}, line {numbered[0][0] + err.lineno - 1}): give a "
                             f"JSON list of objects, or one JSON object per line") from None
        items = items if isinstance(items, list) else [items]
        rows, where = items, [f"item {i} of its list" for i in range(1, len(items) + 1)]
    else:
        rows, where = [], []
        for number, text in numbered:
            try:
                rows.append(json.loads(text))
            except ValueError as err:
                raise UsageError(f"{source}: line {number} is not JSON ({err.msg}): write one JSON object per line, "
                                 f"e.g. {EXAMPLE}") from None
            where.append(f"line {number}")
    for row, at in zip(rows, where):
        if not isinstance(row, dict):
            raise UsageError(f"{source}: {at} is {_kind(row)}, not a JSON object: write one object per line, e.g. "
                             f"{EXAMPLE}")
    return rows, where


def _csv_rows(path: Path, source: str) -> tuple[list[dict], list[str]]:
    """The rows of a CSV file (plain prompt/completion text: every field is text, an empty one ''), checked to
    have as many fields as the header."""
    limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)
    try:
        reader = csv.reader(text for _, text in utf8_lines(path, source, source.split()[0]))
        header = next(reader, None)
        if not header:
            raise UsageError(f"{source} is empty: give a header line (prompt,completion) and a row per example")
        rows, where = [], []
        for fields in reader:
            if not "".join(fields).strip() and len(fields) <= 1:
                continue  # a blank line
            if len(fields) != len(header):
                raise UsageError(f"{source}: the row ending on line {reader.line_num} has {len(fields)} fields, the "
                                 f"header {len(header)} ({','.join(header)}): quote a field that holds a comma or a "
                                 f"line break (\"a, b\"), close every quote, or fix the row")
            rows.append(dict(zip(header, fields)))
            where.append(f"line {reader.line_num}")
    except csv.Error as err:
        raise UsageError(f"{source} is not CSV that can be read ({err}): fix the file") from None
    finally:
        csv.field_size_limit(limit)
    if "messages" in header or not rows:
        raise UsageError(f"{source}: " + ("a CSV holds plain 'prompt' and 'completion' text: give conversations as "
                                          "JSON lines or Parquet" if rows else "a header but no rows: give a row per "
                                          "example"))
    return rows, where


def read_file(path: Path, shown: str, flag: str) -> tuple[Dataset, list[str] | None]:
    """A --train_file or --validation_file as a table, and where each row is (None: 'row N')."""
    source = f"{flag} '{shown}'"
    if path.is_dir():
        raise UsageError(f"{source} is a folder: give a .jsonl, .json, .parquet or .csv file (a folder of them loads "
                         f"with --dataset_name FOLDER)")
    kind = KINDS.get(path.suffix.lower())
    if kind is None:
        raise UsageError(f"{source} must be .jsonl, .json, .parquet or .csv (CSV: plain prompt/completion text)")
    if kind == "parquet":
        return _parquet(path, source), None
    rows, where = (_json_rows if kind == "json" else _csv_rows)(path, source)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    fmt = detect(columns, rows[0], source)
    for row, at in zip(rows, where):
        check_row(row, fmt, at, source)
    keys = ("messages",) if fmt == "messages" else ("prompt", "completion")
    try:
        return Dataset.from_list([{key: row[key] for key in keys} for row in rows]), where
    except Exception as err:  # noqa: BLE001  (pyarrow: a message key holding numbers in one row, text in another)
        from .checks import deepest_message

        raise UsageError(f"{source}: its messages could not be made into a table ({deepest_message(err)}): give "
                         f"each key of the messages one kind of value in every row") from None


def sources(data: DataSettings,
            val_fraction: float) -> tuple[dict[str, tuple[Dataset, str, list[str] | None]], str]:
    """{'train': (table, source shown in errors, where each row is), 'validation': (...)} and where validation
    comes from (the banner's phrase)."""
    given = validation_path(data)
    if given is not None and "val_fraction" in (data.dataset_args or {}):
        raise UsageError(f"--dataset_args val_fraction={data.dataset_args['val_fraction']} sets the share split off "
                         f"for validation, but --validation_file '{data.validation_file}' is the validation data: drop "
                         f"one of them")
    if data.dataset_name:
        if data.train_file:
            raise UsageError(f"--dataset_name {data.dataset_name} and --train_file {data.train_file}: give one")
        from .hub import load

        parts, source = load(data.dataset_name, data.dataset_config), f"--dataset_name {data.dataset_name}"
        if "train" not in parts:
            raise UsageError(f"{source} has no 'train' split (it has {', '.join(parts)}): give a dataset with one")
        train = (parts["train"], f"{source} (train split)", None)
        own = next((name for name in SPLITS if name in parts), None)
        if given is None and own is not None:
            return {"train": train, "validation": (parts[own], f"{source} ({own} split)", None)}, \
                f"the dataset's '{own}' split"
    else:
        path = _local_path(data, "a .jsonl, .json, .parquet or .csv file of conversations or prompt/completion rows")
        table, where = read_file(path, data.train_file, "--train_file")
        train = (table, f"--train_file '{data.train_file}'", where)
    if given is not None:
        table, where = read_file(given, data.validation_file, "--validation_file")
        return {"train": train, "validation": (table, f"--validation_file '{data.validation_file}'", where)}, \
            f"--validation_file '{data.validation_file}'"
    return share(train, val_fraction), f"a seeded {val_fraction:.0%} share of the training rows"


def share(train: tuple[Dataset, str, list[str] | None], val_fraction: float) -> dict:
    """A seeded `val_fraction` of the rows for validation (at least one on each side), both in the file's order."""
    import numpy as np

    table, source, where = train
    if not 0 < val_fraction < 1:
        raise UsageError(f"val_fraction={val_fraction} must be between 0 and 1: e.g. --dataset_args val_fraction=0.1")
    splittable(len(table), val_fraction, source)
    order = np.random.default_rng(SEED).permutation(len(table))
    cut = int(np.ceil(len(table) * val_fraction))
    parts = {}
    for name, picked in (("train", np.sort(order[cut:])), ("validation", np.sort(order[:cut]))):
        parts[name] = (table.select(picked), source, [where[i] if where else f"row {i + 1}" for i in picked])
    return parts


def _tokenized(table: Dataset, source: str, where: list[str] | None, renderer: Renderer, split: str) -> tuple:
    """The table as training rows (inputs, labels), and (rows dropped, rows cut at the block)."""
    fmt = renderer.fmt

    def rows(batch, indices):
        out = {"inputs": [], "labels": [], "cut": []}
        for i, row in zip(indices, ({k: batch[k][n] for k in batch} for n in range(len(indices)))):
            at = where[i] if where is not None else f"row {i + 1}"
            check_row(row, fmt, at, source)
            made = renderer.block_row(*renderer.ids_and_targets(row, at))
            if made is not None:
                for key, value in zip(out, made):
                    out[key].append(value)
        return out

    mapped = table.map(rows, batched=True, batch_size=1000, with_indices=True, remove_columns=table.column_names,
                       desc=f"chat tokens ({split}, block {renderer.block})")
    cut = sum(mapped["cut"]) if "cut" in mapped.column_names else 0
    return mapped.select_columns(["inputs", "labels"]) if len(mapped) else mapped, len(table) - len(mapped), cut


def _notice(parts: dict, counts: dict, block: int, fmt: str) -> None:
    """One line on the main process when rows were dropped or cut; one line, exit 2, when a split has none left."""
    loss = "--assistant_only_loss" if fmt == "messages" else "--completion_only_loss"
    said = []
    for split, (table, dropped, cut) in counts.items():
        source = parts[split][1]
        if len(table) == 0:
            raise UsageError(f"{source}: none of its {dropped:,} {split} rows has a target token within --block_size "
                             f"{block} (with {loss} only the {'assistant' if fmt == 'messages' else 'completion'}'s "
                             f"tokens are targets): give a larger --block_size, shorter prompts, or rows with an "
                             f"{'assistant message' if fmt == 'messages' else 'answer'}")
        if dropped or cut:
            said.append(f"{split} {dropped:,} of {len(table) + dropped:,} rows dropped (no target token within the "
                        f"block), {cut:,} cut to it")
    if said and int(os.environ.get("RANK", "0")) == 0:
        print(f"chat data, --block_size {block}: {'; '.join(said)}", flush=True)


@register("chat", ARGS)
def chat(data: DataSettings, cfg: ModelSettings, seed: int) -> DataBundle:
    a = _args(data)
    if not a["tokenizer"] or not a["block_size"]:
        raise UsageError("--dataset chat renders conversations with a transformers model's tokenizer: add "
                         "--model_name_or_path FOLDER (or --config_name with --tokenizer_name)")
    parts, validation_from = sources(data, a["val_fraction"])
    table, source, _ = parts["train"]
    fmt = detect(table.column_names, table[0] if len(table) else {}, source)
    for split, (other, shown, _) in parts.items():  # a validation file or split of another format
        if split != "train" and len(other) and detect(other.column_names, other[0], shown) != fmt:
            raise UsageError(f"{shown} is in another format than the training rows ({fmt.replace('_', '/')}): give "
                             f"both in one format")
    tok = HFTokenizer(a["tokenizer"], hf_flag(cfg))
    check_template(tok.tok, fmt, hf_flag(cfg), a["tokenizer"])
    masked = data.assistant_only_loss if fmt == "messages" else data.completion_only_loss
    counts = {}
    for split, (table, shown, where) in parts.items():
        renderer = Renderer(tok.tok, fmt, masked, a["block_size"], shown)
        counts[split] = _tokenized(table, shown, where, renderer, split)
    _notice(parts, counts, a["block_size"], fmt)
    info = {"task": "language_modeling", "vocab_size": tok.vocab_size, "block_size": a["block_size"],
            "tokenizer": tok.name, "variable_targets": True, "validation_from": validation_from, "chat_format": fmt,
            "dropped_rows": {split: c[1] for split, c in counts.items()}}
    return DataBundle(counts["train"][0], counts["validation"][0], info, decode=tok.decode, encode=tok.encode)
