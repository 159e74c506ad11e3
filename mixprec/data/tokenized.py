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
"""
from __future__ import annotations

import numpy as np
from datasets import load_dataset

from ..errors import UsageError
from ..settings import Setting, fraction, positive
from . import DataBundle, _args, _local_path, register
from .text import tail_split

ARGS = {"tokenizer": Setting(None, str, optional=True), "block_size": positive(128), "num_labels": positive(2),
        "val_fraction": fraction(0.2), "text_column": Setting(None, str, optional=True),
        "text_pair_column": Setting(None, str, optional=True), "label_column": Setting("label", str)}
PAIRS = (("text", "text_pair"), ("sentence1", "sentence2"), ("sentence", None))  # the usual column names


def _load_tokenizer(name: str | None):
    from transformers import AutoTokenizer

    if not name:
        raise UsageError("--dataset text_classification tokenizes with a transformers model's tokenizer: add "
                         "--model_name_or_path or --config_name with --tokenizer_name")
    try:
        tok = AutoTokenizer.from_pretrained(name)
    except Exception as err:  # noqa: BLE001  (a broken folder, offline)
        raise UsageError(f"tokenizer '{name}' could not be loaded ({type(err).__name__}): check the folder") from None
    if tok.pad_token_id is None:
        raise UsageError(f"tokenizer '{name}' has no pad token, which classification batches need: save the "
                         f"tokenizer with one (tokenizer.pad_token = ...; save_pretrained)")
    return tok


def _columns(ds, a: dict, source: str) -> list[str]:
    """The text column(s) to tokenize, renamed `text`/`text_pair`, and `label`; checked to be text and
    integers."""
    text, pair = a["text_column"], a["text_pair_column"]
    if text is None:  # the usual names; a text_pair_column given alone is kept
        found, usual = next(((t, p if p in ds.column_names else None) for t, p in PAIRS if t in ds.column_names),
                            ("text", None))
        text, pair = found, pair if pair is not None else usual
    for name in (text, a["label_column"], pair):
        if name is not None and name not in ds.column_names:
            raise UsageError(f"{source} has no '{name}' column (it has {', '.join(ds.column_names)}): give "
                             f"'text' (and optionally 'text_pair') and an integer 'label', or name them with "
                             f"--dataset_args text_column=...,label_column=...")
    columns = [text, *([pair] if pair else [])]
    for col in columns:
        if ds.features[col].dtype not in ("string", "large_string"):
            raise UsageError(f"{source}: column '{col}' is not text ({ds.features[col].dtype}): give text in it")
    for col in (*columns, a["label_column"]):
        empty = ds.data.column(col).null_count  # an empty field, or a split without the column
        if empty:
            raise UsageError(f"{source}: column '{col}' is empty in {empty} of {len(ds)} rows: fill them in or "
                             f"drop those rows")
    if ds.features[a["label_column"]].dtype not in ("int8", "int16", "int32", "int64"):
        raise UsageError(f"{source}: column '{a['label_column']}' is not integer "
                         f"({ds.features[a['label_column']].dtype}): give class numbers")
    return columns


@register("text_classification", ARGS)
def text_classification(cfg) -> DataBundle:
    a = _args(cfg)
    if cfg.dataset_name:  # the Hub (or a local folder that load_dataset reads)
        if cfg.train_file:
            raise UsageError(f"--dataset_name {cfg.dataset_name} and --train_file {cfg.train_file}: give one")
        from .hub import load
        from .images import with_validation

        tok = _load_tokenizer(a["tokenizer"])
        parts = with_validation(load(cfg.dataset_name, cfg.dataset_config), a["val_fraction"])
        source = f"--dataset_name {cfg.dataset_name}"
    else:
        path = _local_path(cfg, "a .csv or .jsonl file with 'text' and 'label' columns")
        kind = {".csv": "csv", ".json": "json", ".jsonl": "json"}.get(path.suffix.lower())
        if kind is None:
            raise UsageError(f"--train_file '{cfg.train_file}' must be .csv, .json or .jsonl")
        tok = _load_tokenizer(a["tokenizer"])
        parts = tail_split(load_dataset(kind, data_files=str(path), split="train"), a["val_fraction"])
        source = f"--train_file '{cfg.train_file}'"
    columns = _columns(parts["train"], a, source)
    for name in set(parts) - {"train"}:  # a Hub dataset's validation split may differ from its train split
        _columns(parts[name], a, f"{source} ({name} split)")
    block, label = a["block_size"], a["label_column"]

    def encode(batch):
        enc = tok(*[batch[c] for c in columns], truncation=True, max_length=block, padding="max_length")
        return {"inputs": np.asarray(enc["input_ids"], dtype=np.int64), "labels": batch[label]}

    mapped = {k: v.map(encode, batched=True, remove_columns=v.column_names, desc=f"tokens ({k})")
              for k, v in parts.items()}
    info = {"task": "classification", "num_classes": a["num_labels"], "vocab_size": len(tok),
            "block_size": block, "pad_token_id": tok.pad_token_id, "tokenizer": a["tokenizer"]}
    return DataBundle(mapped["train"], mapped["validation"], info)
