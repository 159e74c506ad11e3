"""Text classification for transformers models (`--dataset text_classification`), as transformers' run_glue.py
reads its files: a CSV or JSON-lines `--train_file` with a `text` column, an optional second text column
`text_pair` (sentence pairs, as in GLUE MRPC) and a `label` column of class numbers or class names ("pos",
"neg": sorted, numbered 0..C-1, mixprec.data.class_labels), tokenized with the model's tokenizer
(`--tokenizer_name`, else the model's folder), padded and truncated to `--block_size` tokens. `inputs` are the
token ids (padding is the tokenizer's pad token, which the model masks out; a tokenizer without one pads with its
EOS token, as is common for decoder-only models, and the banner says so), `labels` the class. Validation is
`--validation_file` (a file of the same form, checked the same way), else the last `val_fraction` of the rows.

Or a dataset that `datasets.load_dataset` loads (`--dataset_name glue --dataset_config mrpc`: the Hub, or a
local folder of CSV/JSON/Parquet files): its validation split (else test, else a share of train); the text
columns are `text` (and `text_pair`), else GLUE's `sentence1` and `sentence2`, else `sentence`, or
`--dataset_args text_column=...,text_pair_column=...`; the label column is `label` (`label_column=...`).

Files are read line by line before `datasets` parses them (mixprec.data.class_files: a bad file is one line naming
the file, the line and the fix); the classes and the head's size (`--num_labels`, else the data's) are
mixprec.data.class_labels. `info` gives the model the head's size (`num_classes`), the class names
(`label_names`) and `id2label` for its config, and the pad token.
"""
from __future__ import annotations

import glob
from pathlib import Path

import numpy as np

from ..errors import UsageError
from ..typed_args import Setting, fraction, positive
from . import DataBundle, _args, _local_path, register, validation_path
from . import class_labels
from .checks import deepest_message
from .class_files import file_kind, names, scan
from .text import tail_split

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config.sections import DataSettings, ModelSettings

ARGS = {"tokenizer": Setting(None, str, optional=True), "block_size": positive(128), "num_labels": positive(2),
        "val_fraction": fraction(0.2), "text_column": Setting(None, str, optional=True),
        "text_pair_column": Setting(None, str, optional=True), "label_column": Setting("label", str),
        "checkpoint_labels": Setting(None, list, optional=True, item=str)}  # set by mixprec.models.hf_flags
INTEGERS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")
OWN_SPLITS = ("validation", "valid", "val", "test")  # mixprec.data.images.with_validation's order


def _load_tokenizer(name: str | None):
    """The model's tokenizer, and whether its EOS token pads (it has no pad token of its own)."""
    from transformers import AutoTokenizer

    from ..models.hf_folder import remote_code
    if not name:
        raise UsageError("--dataset text_classification tokenizes with a transformers model's tokenizer: add "
                         "--model_name_or_path or --config_name with --tokenizer_name")
    try:
        tok = AutoTokenizer.from_pretrained(name, **remote_code())
    except Exception as err:  # noqa: BLE001  (a broken folder, offline)
        raise UsageError(f"tokenizer '{name}' could not be loaded ({type(err).__name__}): check the folder") from None
    if tok.pad_token_id is not None:
        return tok, False
    if tok.eos_token_id is None:
        raise UsageError(f"tokenizer '{name}' has neither a pad token nor an EOS token, and classification batches "
                         f"are padded: save the tokenizer with a pad token (tokenizer.pad_token = ...; "
                         f"save_pretrained)")
    tok.pad_token = tok.eos_token  # decoder-only models (Llama, GPT-2): the common choice, said in the banner
    return tok, True


def _columns(ds, a: dict, source: str) -> list[str]:
    """The text column(s) to tokenize of a loaded table, checked to be text, and its label column to be class
    numbers or class names."""
    columns, label = names(ds.column_names, a, source)
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
    if kind not in (*INTEGERS, "string", "large_string"):
        why = ("regression (transformers' num_labels=1 head) is not supported: " if str(kind).startswith("float")
               else "false is 0 and true 1: " if kind == "bool" else "")
        raise UsageError(f"{source}: column '{label}' is neither class numbers nor class names ({kind}): {why}give "
                         f"class numbers 0, 1, ... or class names")
    return columns


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


def _from_files(data: DataSettings, a: dict) -> tuple[dict, dict, dict]:
    """--train_file (and --validation_file): scanned line by line, then loaded. (parts, {class: where first}
    of the label column, what names the validation rows)."""
    from datasets import DatasetDict

    label = a["label_column"]
    path = _local_path(data, "a .csv or .jsonl file with 'text' and 'label' columns")
    source, kind = f"--train_file '{data.train_file}'", file_kind(path, "--train_file", data.train_file)
    found = scan(path, kind, a, source, "--train_file")[label].classes
    valid = validation_path(data)
    if valid is not None and "val_fraction" in (data.dataset_args or {}):
        raise UsageError(f"--dataset_args val_fraction={data.dataset_args['val_fraction']} with --validation_file: "
                         f"the validation rows are the file's, no share of --train_file: drop one")
    if valid is None:
        if found and isinstance(next(iter(found)), int):  # before datasets reads a number beyond int64 as a float
            class_labels.check_numbers(found, source)
        table = _load_file(path, kind, source)
        rows = f"the last {a['val_fraction']:.0%} of --train_file's rows"
        return tail_split(table, a["val_fraction"]), found, {"source": source, "rows": rows}
    vsource, vkind = f"--validation_file '{data.validation_file}'", file_kind(valid, "--validation_file",
                                                                             data.validation_file)
    seen = scan(valid, vkind, a, vsource, "--validation_file")[label].classes
    if {type(v) for v in found} != {type(v) for v in seen}:
        what = {int: "class numbers", str: "class names"}
        raise UsageError(f"{vsource}: column '{label}' holds {what[type(next(iter(seen)))]}, --train_file "
                         f"'{data.train_file}' {what[type(next(iter(found)))]}: give the same kind in both")
    numbers = {**{k: f"{where} of --validation_file" for k, where in seen.items()}, **found}
    if isinstance(next(iter(found)), int):  # before datasets reads a number beyond int64 as a float
        class_labels.check_numbers(numbers, source)
    parts = DatasetDict(train=_load_file(path, kind, source), validation=_load_file(valid, vkind, vsource))
    return parts, numbers, {"source": vsource, "rows": vsource, "seen": seen}


def _from_dataset(data: DataSettings, a: dict) -> tuple[dict, None, dict]:
    """--dataset_name (the Hub, or a local folder that load_dataset reads): its validation split, else a share."""
    from .hub import load
    from .images import with_validation

    if data.train_file:
        raise UsageError(f"--dataset_name {data.dataset_name} and --train_file {data.train_file}: give one")
    if data.validation_file:
        raise UsageError(f"--validation_file goes with --train_file; --dataset_name {data.dataset_name} brings its "
                         f"own validation split (else a share of its train split): drop --validation_file")
    loaded = load(data.dataset_name, data.dataset_config)
    own = next((name for name in OWN_SPLITS if name in loaded), None)
    rows = (f"the dataset's {own} split" if own else
            f"a seeded {a['val_fraction']:.0%} share of the dataset's train split")
    return with_validation(loaded, a["val_fraction"]), None, {"source": f"--dataset_name {data.dataset_name} ({rows})",
                                                              "rows": rows}


@register("text_classification", ARGS)
def text_classification(data: DataSettings, cfg: ModelSettings, seed: int) -> DataBundle:
    a = _args(data)
    label = a["label_column"]
    given = data.num_labels
    if given is not None and given < 2:  # hf_flags refuses it first; here for a settings object made in code
        raise UsageError(f"--num_labels {given}: one output is transformers' regression head, which is not "
                         f"supported: give 2 or more (default: the classes in the data)")
    source = f"--dataset_name {data.dataset_name}" if data.dataset_name else f"--train_file '{data.train_file}'"
    parts, found, validation = (_from_dataset if data.dataset_name else _from_files)(data, a)
    columns = _columns(parts["train"], a, source)
    for name in set(parts) - {"train"}:  # a Hub dataset's validation split may differ from its train split
        _columns(parts[name], a, f"{source} ({name} split)" if data.dataset_name else validation["source"])
    if class_labels.is_words(parts["train"], label) != class_labels.is_words(parts["validation"], label):
        raise UsageError(f"{validation['source']}: column '{label}' holds class numbers in one of training and "
                         f"validation and class names in the other: give the same kind in both")
    class_labels.one_class(parts, label, source, tail=not (data.dataset_name or data.validation_file))
    classes = class_labels.decide(parts, label, given, a["num_labels"], source, found, validation,
                                  a["checkpoint_labels"])
    tok, eos_pads = _load_tokenizer(a["tokenizer"])
    block, to_id = a["block_size"], {name: i for i, name in enumerate(classes.names or ())}

    def encode(batch):
        enc = tok(*[batch[c] for c in columns], truncation=True, max_length=block, padding="max_length")
        ids = [to_id[v] for v in batch[label]] if to_id else batch[label]
        return {"inputs": np.asarray(enc["input_ids"], dtype=np.int64), "labels": np.asarray(ids, dtype=np.int64)}

    mapped = {k: v.map(encode, batched=True, remove_columns=v.column_names, desc=f"tokens ({k})")
              for k, v in parts.items()}
    info = {"task": "classification", "num_classes": classes.num_labels, "vocab_size": len(tok),
            "block_size": block, "pad_token_id": tok.pad_token_id, "tokenizer": a["tokenizer"],
            "label_names": classes.names, "classes_from": classes.order, "id2label": classes.id2label, "checkpoint_num_labels": a["num_labels"],
            "validation_from": validation["rows"]}
    if eos_pads:
        info["pad_from_eos"] = tok.eos_token
    return DataBundle(mapped["train"], mapped["validation"], info)
