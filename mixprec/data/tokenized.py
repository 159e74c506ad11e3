"""Text classification for transformers models (`--dataset text_classification`): a CSV or JSON-lines
`--train_file` with a `text` column, an optional second text column `text_pair` (sentence pairs, as in GLUE
MRPC) and an integer `label` column, tokenized with the model's tokenizer (`--tokenizer_name`, else the
model's folder), padded and truncated to `--block_size` tokens. `inputs` are the token ids (padding is the
tokenizer's pad token, which the model masks out), `labels` the class. The last `val_fraction` of the rows is
validation. The labels are checked against the model's `num_labels` (mixprec.models.hf_flags passes it).
"""
from __future__ import annotations

import numpy as np
from datasets import load_dataset

from ..errors import UsageError
from ..settings import Setting, fraction, positive
from . import DataBundle, _args, _local_path, register
from .text import tail_split

ARGS = {"tokenizer": Setting(None, str, optional=True), "block_size": positive(128), "num_labels": positive(2),
        "val_fraction": fraction(0.2)}


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


def _check_columns(ds, path: str) -> list[str]:
    missing = [c for c in ("text", "label") if c not in ds.column_names]
    if missing:
        raise UsageError(f"--train_file '{path}' has no '{missing[0]}' column: give 'text' (and optionally "
                         f"'text_pair') and an integer 'label'")
    columns = ["text", *(["text_pair"] if "text_pair" in ds.column_names else [])]
    for col in columns:
        if ds.features[col].dtype not in ("string", "large_string"):
            raise UsageError(f"--train_file '{path}': column '{col}' is not text ({ds.features[col].dtype}): give "
                             f"text in it")
    if ds.features["label"].dtype not in ("int8", "int16", "int32", "int64"):
        raise UsageError(f"--train_file '{path}': column 'label' is not integer ({ds.features['label'].dtype}): "
                         f"give class numbers")
    return columns


@register("text_classification", ARGS)
def text_classification(cfg) -> DataBundle:
    a = _args(cfg)
    path = _local_path(cfg, "a .csv or .jsonl file with 'text' and 'label' columns")
    kind = {".csv": "csv", ".json": "json", ".jsonl": "json"}.get(path.suffix.lower())
    if kind is None:
        raise UsageError(f"--train_file '{cfg.train_file}' must be .csv, .json or .jsonl")
    tok = _load_tokenizer(a["tokenizer"])
    ds = load_dataset(kind, data_files=str(path), split="train")
    columns = _check_columns(ds, cfg.train_file)
    block = a["block_size"]

    def encode(batch):
        enc = tok(*[batch[c] for c in columns], truncation=True, max_length=block, padding="max_length")
        return {"inputs": np.asarray(enc["input_ids"], dtype=np.int64), "labels": batch["label"]}

    parts = tail_split(ds, a["val_fraction"])
    mapped = {k: v.map(encode, batched=True, remove_columns=v.column_names, desc=f"tokens ({k})")
              for k, v in parts.items()}
    info = {"task": "classification", "num_classes": a["num_labels"], "vocab_size": len(tok),
            "block_size": block, "pad_token_id": tok.pad_token_id, "tokenizer": a["tokenizer"]}
    return DataBundle(mapped["train"], mapped["validation"], info)
