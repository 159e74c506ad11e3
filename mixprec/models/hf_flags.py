"""transformers' example-script flags (`--model_name_or_path`, `--config_name`, `--tokenizer_name`,
`--block_size`) mapped onto the recipe's own settings once, while the flags are parsed (`apply`, called by
mixprec.config.parse_config after `check`, which reads no folder): the model becomes
`hf_causal_lm` (`hf_classifier` with --dataset text_classification) with those flags as its `--model_args`,
and the text dataset tokenizes with the model's tokenizer
into blocks of `--block_size` tokens (default: the model's positions, at most 1024). Bad input (a missing
path, a folder without config.json, a block longer than the model's positions) is a UsageError here; so is a
damaged folder (`apply`, through mixprec.models.hf_folder: config.json, the safetensors headers, the tokenizer's
files, read before anything loads), and a setting the transformers flags would silently replace (`check`: --model,
--model_args, --dataset_args block_size/tokenizer/num_labels: --num_labels is the flag) or that has no effect without
them (--save_dtype; --num_labels without --dataset text_classification, or below 2: regression is not supported).
"""
from __future__ import annotations

import re

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UsageError
from . import hf_folder

if TYPE_CHECKING:
    from ..config.sections import DataSettings, ModelSettings

TEXT_DATASETS = ("stdlib", "text", "hub", "chat")
DEFAULT_BLOCK = 1024
CLASSIFY_BLOCK = 128  # padded: every row costs the whole block


def _local_config(flag: str, value: str) -> dict | None:
    """config.json of a local folder; None for what can only be a Hub id ('org/name' that is not on disk)."""
    path = Path(value).expanduser()
    looks_local = path.is_absolute() or value.startswith(".") or path.exists() or value.count("/") > 1
    if not looks_local:
        return None
    if not path.is_dir():
        raise UsageError(f"{flag} '{value}' not found: check the path (a folder with config.json, or a Hub id)")
    if not (path / "config.json").is_file():
        raise UsageError(f"{flag} '{value}' has no config.json: give a folder saved with save_pretrained")
    try:
        config = json.loads((path / "config.json").read_bytes())
    except ValueError:  # not JSON, not UTF-8
        raise UsageError(f"{flag} '{value}': config.json is not valid JSON: fix or replace it") from None
    except OSError as err:
        from ..errors import explain

        raise explain(err, flag, path / "config.json") from None
    if not isinstance(config, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(config), "a number")
        raise UsageError(f"{flag} '{value}': config.json holds {kind}, not an object of settings: fix or replace it "
                         f"(save_pretrained writes one)")
    return config


def _hub_config(flag: str, value: str) -> dict:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise UsageError(f"{flag} '{value}' is not a local folder, and HF_HUB_OFFLINE is set: download it on a "
                         f"connected machine and give its folder")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(value, **hf_folder.remote_code()).to_dict()
    except (OSError, ValueError) as err:
        if "trust_remote_code" in str(err):
            raise hf_folder.refused_code(f"{flag} {value}: config.json", None) from None
        raise UsageError(f"{flag} '{value}' is not a local folder and could not be fetched from the Hub "
                         f"({type(err).__name__}): check the id's spelling and the network (a gated or private "
                         f"model needs `hf auth login`), or download it on a connected machine and give its "
                         f"folder") from None


def _tokenizer(cfg: ModelSettings, flag: str, value: str, local: bool) -> None:
    """The tokenizer's folder (--tokenizer_name, else the model's), checked where it is local."""
    if cfg.tokenizer_name:
        flag, value = "--tokenizer_name", cfg.tokenizer_name
        path = Path(value).expanduser()
        local = path.is_absolute() or value.startswith(".") or path.exists() or value.count("/") > 1
        if local and not path.is_dir():
            raise UsageError(f"--tokenizer_name '{value}' not found: check the path (a folder with the tokenizer's "
                             f"files, or a Hub id)")
    if local:
        hf_folder.tokenizer(flag, value, Path(value).expanduser())


def max_positions(config: dict) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def check(cfg) -> None:
    """The flags' combinations, from the settings alone (when they are parsed)."""
    from . import lora

    lora.check(cfg)
    _num_labels(cfg.data)
    if not (cfg.model_name_or_path or cfg.config_name):
        for name in ("tokenizer_name", "block_size"):
            if getattr(cfg, name) is not None:
                raise UsageError(f"--{name} is for transformers models: add --model_name_or_path or --config_name")
        if cfg.model.startswith("hf_") and "model" in (getattr(cfg, "_given", None) or ()):
            raise UsageError(f"--model {cfg.model} is what --model_name_or_path sets up (its block size, tokenizer and "
                             f"checks): give --model_name_or_path FOLDER (or --config_name with --tokenizer_name) "
                             f"instead of --model and --model_args")
        if cfg.save_dtype != "auto" and not cfg.model.startswith("hf_"):
            raise UsageError(f"--save_dtype {cfg.save_dtype} is the dtype of a transformers model's save_pretrained "
                             f"export; --model {cfg.model} has none (its model.safetensors is fp32): drop --save_dtype, "
                             f"or train a transformers model (--model_name_or_path)")
        return
    _overridden(cfg)
    if cfg.block_size is not None and cfg.block_size < 1:
        raise UsageError(f"--block_size {cfg.block_size} must be positive: give a value above 0")
    if cfg.model_name_or_path and cfg.config_name:
        raise UsageError("give --model_name_or_path (a checkpoint) or --config_name (fresh weights), not both")
    if cfg.config_name and not cfg.tokenizer_name:
        raise UsageError("--config_name builds fresh weights and has no tokenizer: add --tokenizer_name FOLDER")
    if cfg.dataset not in (*TEXT_DATASETS, "text_classification"):
        raise UsageError(f"--model_name_or_path trains a causal language model on text (--dataset stdlib, text, "
                         f"hub or chat) or a classifier (--dataset text_classification), not --dataset {cfg.dataset}")


def _num_labels(data: DataSettings) -> None:
    """--num_labels: a classifier's head of 2 or more outputs (transformers' one output is regression)."""
    given = data.num_labels
    if given is None:
        return
    if data.dataset != "text_classification":
        raise UsageError(f"--num_labels {given} is the head's size of a transformers classifier (--dataset "
                         f"text_classification), not of --dataset {data.dataset}: drop --num_labels")
    if given < 2:
        raise UsageError(f"--num_labels {given}: one output is transformers' regression head (num_labels=1, MSE), "
                         f"which is not supported: give 2 or more, or drop it (default: the classes in the data)")


def _overridden(cfg) -> None:
    """Settings that `apply` sets from the transformers flags, refused where the user gave them (typed or in the
    --config file; a resumed run's record holds what `apply` set)."""
    given = getattr(cfg, "_given", None) or ()  # config.parse_config's record (none: not known, nothing refused)
    flag = "--model_name_or_path" if cfg.model_name_or_path else "--config_name"
    if "model" in given and cfg.model not in ("hf_causal_lm", "hf_classifier"):
        raise UsageError(f"--model {cfg.model} with {flag}: the transformers model is the one trained (--model "
                         f"hf_causal_lm): drop --model, or drop {flag} to train {cfg.model}")
    if "model_args" in given:
        raise UsageError(f"--model_args with {flag}: a transformers model is shaped by its config.json: drop "
                         f"--model_args (or edit a copy of config.json and give it as --config_name)")
    for key, instead in (("block_size", "--block_size N"), ("tokenizer", "--tokenizer_name FOLDER"),
                         ("num_labels", "--num_labels N"), ("checkpoint_labels", "the model's config.json id2label")):
        if f"dataset_args.{key}" in given:
            raise UsageError(f"--dataset_args {key}=... with {flag}: the transformers flags set it: give {instead} "
                             f"instead")


def checkpoint_names(config: dict) -> list[str] | None:
    """A classifier checkpoint's class names in id order (config.json's id2label), or None where it has none of
    its own (transformers' default LABEL_0, LABEL_1, ...; ids that are not 0..n-1)."""
    id2label = {str(k): str(v) for k, v in (config.get("id2label") or {}).items()}
    if not id2label or sorted(id2label) != sorted(map(str, range(len(id2label)))):
        return None
    names = [id2label[str(i)] for i in range(len(id2label))]
    return None if all(re.fullmatch(r"LABEL_\d+", n) for n in names) else names


def apply(cfg) -> dict:
    """The settings a transformers model sets (`model`, `model_args`, `dataset_args`), read from its folders; {}
    when none is asked for. mixprec.config.resolve applies them once, while the flags are parsed."""
    check(cfg)
    hf_folder.REMOTE_CODE["trusted"] = bool(getattr(cfg, "trust_remote_code", False))  # every from_pretrained
    if not (cfg.model_name_or_path or cfg.config_name):
        return {}
    flag, value = (("--model_name_or_path", cfg.model_name_or_path) if cfg.model_name_or_path
                   else ("--config_name", cfg.config_name))
    classify = cfg.dataset == "text_classification"
    local = _local_config(flag, value)
    config = local if local is not None else _hub_config(flag, value)
    source = str(Path(value).expanduser()) if local is not None else value
    hf_folder.model_config(flag, value, config, source, classify)  # a damaged folder: one line, before any load
    if local is not None and cfg.model_name_or_path:
        hf_folder.weights(flag, value, Path(source))
    _tokenizer(cfg, flag, value, local is not None)
    positions = max_positions(config)
    default = CLASSIFY_BLOCK if classify else DEFAULT_BLOCK
    block = cfg.block_size or min(positions or default, default)
    if positions is not None and block > positions:
        raise UsageError(f"--block_size {block} is longer than the model's {positions} positions: give at most "
                         f"{positions}")
    dataset_args = {**cfg.dataset_args, "tokenizer": cfg.tokenizer_name or value, "block_size": block}
    if classify:
        # the checkpoint's head: kept where the data's classes fit it, else replaced (mixprec.data.class_labels)
        dataset_args["num_labels"] = len(config.get("id2label") or {}) or config.get("num_labels") or 2
        named = checkpoint_names(config)
        if named:  # a fine-tuned classifier's own class names: class names in the data follow its order
            dataset_args["checkpoint_labels"] = named
    return {"model": "hf_classifier" if classify else "hf_causal_lm", "dataset_args": dataset_args,
            "model_args": {"name_or_path": cfg.model_name_or_path, "config_name": cfg.config_name,
                           "tokenizer_name": cfg.tokenizer_name, "block_size": block}}
