"""Recipe configuration: built-in defaults < YAML file (`--config`) < command-line flags.

Every setting is one field of `TrainConfig`. The same field is a YAML key and a flag
(`--batch_size 64` or `batch_size: 64`), is checked by `validate`, and is written back,
fully resolved, to `<output_dir>/config.yaml`.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from .arg_parser import Parser
from .errors import UsageError
from .threads import usable_cores

PRECISIONS = ("auto", "no", "fp16", "bf16", "fp8")  # fp8: GPUs with fp8 tensor cores only
EVAL_PRECISIONS = ("fp32", "same")
LR_SCHEDULES = ("constant", "linear", "cosine")
ON_NAN = ("skip", "halt")
SAVE_DTYPES = ("auto", "fp32", "bf16", "fp16")
MAX_LR = 1.0  # AdamW: a step moves each weight by up to about lr


def _opt(default, help, type=str, choices=None):
    meta = {"help": help, "type": type, "choices": choices}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class TrainConfig:
    _given = None  # not a setting: parse_config's record of what was typed or in the --config file (set_by_user)
    _hf_resolved = False  # not a setting: the transformers flags resolved into the settings (`resolve`)
    # what to train
    config: str | None = _opt(None, "YAML recipe config (see recipes/configs/); flags override its values (default: none)")
    model: str = _opt("mlp", "model from the registry in mixprec/models/")
    model_args: dict = _opt({}, "model settings as key=value,key=value (override the preset); a list in brackets: "
                                "hidden=[512,256]", dict)
    dataset: str = _opt("synthetic", "dataset from the registry in mixprec/data/")
    dataset_args: dict = _opt({}, "dataset settings as key=value,key=value (a list in brackets: key=[a,b])", dict)
    train_file: str | None = _opt(None, "local data: a CSV / JSON lines file with a 'label' column for --dataset "
                                        "file, a .txt file or folder for --dataset text, an image folder for "
                                        "--dataset imagefolder (default: none)")
    model_name_or_path: str | None = _opt(None, "a transformers causal LM to fine-tune: a folder saved with "
                                                "save_pretrained, or a Hub id (sets --model hf_causal_lm; "
                                                "docs/hf-models.md) (default: none)")
    config_name: str | None = _opt(None, "a folder with a transformers config.json: train that model from fresh "
                                         "weights (needs --tokenizer_name) (default: none)")
    tokenizer_name: str | None = _opt(None, "the tokenizer of --model_name_or_path / --config_name (default: the "
                                            "model's own folder)")
    block_size: int | None = _opt(None, "transformers models: tokens per training block (default: the model's "
                                        "positions, at most 1024)", int)
    save_dtype: str = _opt("auto", "transformers models: dtype of the save_pretrained export; auto = the "
                           "checkpoint's own", choices=SAVE_DTYPES)
    use_peft: bool = _opt(False, "train LoRA adapters (peft) in fp32 on the transformers model's base, frozen in "
                          "the autocast dtype (bf16 by default; docs/hf-models.md)", bool)
    lora_r: int = _opt(16, "LoRA rank (with --use_peft)", int)
    lora_alpha: float = _opt(32.0, "LoRA alpha: the adapters' output is scaled by alpha / r (with --use_peft)", float)
    lora_dropout: float = _opt(0.05, "dropout on the adapters' input (with --use_peft)", float)
    lora_target_modules: list = _opt([], "modules that get adapters: names such as q_proj,v_proj, or all-linear "
                                     "(default: peft's list for the architecture: q_proj,v_proj for Llama, c_attn "
                                     "for GPT-2)", list)
    merge_lora: bool = _opt(False, "with --use_peft, also export the model with the adapters merged in "
                            "(hf_model/, the full model's export and range audit)", bool)
    allow_nonfinite_data: bool = _opt(False, "keep NaN, inf and empty values of --train_file's features (refused by "
                                             "default, naming the file, row and column)", bool)
    # precision
    mixed_precision: str = _opt("auto", "training precision; auto = bf16 where native, else fp16 on CUDA, else fp32; "
                                "fp8 needs an Ada/Hopper GPU and TransformerEngine or torchao",
                                choices=PRECISIONS)
    eval_precision: str = _opt("fp32", "evaluation precision: fp32 (autocast off) or same as training",
                               choices=EVAL_PRECISIONS)
    fp32_modules: list = _opt([], "modules kept in fp32 under mixed precision: comma-separated globs over the model's "
                              "module names, e.g. 'head,h.*.ln_*' (a list in YAML)", list)
    master_weights: str = _opt("fp32", "where the master weights live: fp32 (autocast on fp32 weights) or bf16 (the "
                               "weights themselves bf16, no fp32 copy; needs --mixed_precision bf16; see "
                               "docs/master-weights.md)", choices=("fp32", "bf16"))
    bf16_update: str = _opt("kahan", "with --master_weights bf16, how an update reaches the bf16 weight: round (to "
                            "nearest: small updates are lost), kahan (compensated) or stochastic (rounding)",
                            choices=("round", "kahan", "stochastic"))
    init_scale: float = _opt(65536.0, "GradScaler initial loss scale (fp16 only)", float)
    growth_interval: int = _opt(2000, "GradScaler: steps without overflow before the scale doubles (fp16 only)", int)
    # batch and optimisation
    batch_size: int = _opt(32, "batch size per device (per process)", int)
    eval_batch_size: int | None = _opt(None, "evaluation batch size per device (default: --batch_size)", int)
    gradient_accumulation_steps: int = _opt(1, "micro-batches accumulated into one optimizer step", int)
    lr: float = _opt(1e-3, "peak learning rate (AdamW)", float)
    scale_lr: bool = _opt(False, "scale --lr by global batch / --base_batch_size (the lesson's rule)", bool)
    base_batch_size: int = _opt(32, "the global batch size that --lr is tuned for (used by --scale_lr)", int)
    weight_decay: float = _opt(0.01, "AdamW weight decay", float)
    warmup_steps: int = _opt(20, "optimizer steps of linear warmup from 0 to --lr", int)
    lr_schedule: str = _opt("cosine", "learning rate after warmup", choices=LR_SCHEDULES)
    min_lr_ratio: float = _opt(0.1, "final learning rate of linear/cosine decay, as a fraction of --lr", float)
    num_epochs: int = _opt(10, "passes over the training set", int)
    max_steps: int | None = _opt(None, "stop after this many optimizer steps (default: --num_epochs decides)", int)
    max_grad_norm: float = _opt(1.0, "clip the gradient norm to this value; 0 turns clipping off", float)
    seed: int = _opt(42, "random seed for data, initialisation and shuffling", int)
    # outputs, checkpoints, logging
    output_dir: str | None = _opt(None, "run folder (default: runs/<model>-<dataset>-<date>-<time>)")
    overwrite_output_dir: bool = _opt(False, "replace another run's files in --output_dir", bool)
    checkpointing_steps: int | None = _opt(None, "save a checkpoint every N optimizer steps (default: only at the end)", int)
    checkpoints_total_limit: int = _opt(2, "keep at most this many checkpoints (oldest removed)", int)
    resume_from_checkpoint: str | None = _opt(None, "'latest' (in --output_dir) or a checkpoint folder to resume (default: start afresh)")
    allow_config_change: list = _opt([], "on resume, settings that may differ from the checkpoint's and take effect "
                                     "from the resume step: lr, weight_decay, max_grad_norm, init_scale, "
                                     "growth_interval, warmup_steps, lr_schedule, min_lr_ratio, global_batch, tf32",
                                     list)
    log_every: int = _opt(50, "log metrics every N optimizer steps", int)
    eval_steps: int | None = _opt(None, "also evaluate every N optimizer steps (default: after each epoch only)", int)
    num_workers: int = _opt(0, "DataLoader worker processes", int)
    cpu_threads: int | None = _opt(None, "CPU threads per process (default: usable cores / processes per node; one for "
                                              "a model too small to split, see docs/performance.md)", int)
    # models and data at scale, speed options
    dataset_name: str | None = _opt(None, "Hugging Face Hub dataset for --dataset hub, e.g. mnist, cifar10, "
                                          "wikitext, or text_classification, e.g. glue (default: none)")
    dataset_config: str | None = _opt(None, "its configuration, e.g. wikitext-2-raw-v1 (default: none)")
    compile: bool = _opt(False, "torch.compile the model (in place: checkpoints stay interchangeable)", bool)
    tf32: bool = _opt(False, "fp32 matmuls and convolutions in TF32 (CUDA, Ampere or newer)", bool)
    activation_checkpointing: bool = _opt(False, "recompute each GPT block in the backward pass to save memory", bool)
    gradient_checkpointing: bool = _opt(False, "transformers' name: recompute each layer of a transformers model (and "
                                               "of the GPT) in the backward pass to save memory", bool)
    peak_flops: float | None = _opt(None, "the device's peak FLOP/s for MFU (default: the table in mixprec/metrics.py, "
                                          "else measured at start-up)", float)
    sample_tokens: int = _opt(200, "language models: tokens to generate after training (0: none)", int)
    sample_prompt: str | None = _opt(None, "language models: the prompt (default: the start of the first "
                                           "validation block)")

    # experiment tracking
    report_to: str = _opt("none", "experiment trackers: wandb (online when logged in, else offline), tensorboard, "
                          "all (both) or none; metrics.jsonl and metrics.png are written in every case",
                          choices=("none", "wandb", "tensorboard", "all"))
    project: str = _opt("mixprec", "W&B project of the run")
    run_name: str | None = _opt(None, "W&B run name (default: the name of --output_dir)")
    tags: list = _opt([], "W&B tags, comma-separated: --tags fp16,baseline (a list in YAML)", list)

    # health checks
    health_checks: bool = _opt(True, "watch every optimizer step for NaN/Inf, overflow, stalls and exploding gradients "
                               "(one host sync per step)", bool)
    on_nan: str = _opt("skip", "a NaN/Inf loss (or, in bf16/fp32, gradient): skip that optimizer step, or halt "
                       "(exit code 3, last checkpoint kept)", choices=ON_NAN)
    max_skipped_steps: int = _opt(10, "diagnose this many skipped optimizer steps in a row (0: off)", int)
    min_loss_scale: float = _opt(1.0, "fp16: diagnose a GradScaler scale below this (0: off)", float)
    flat_loss_window: int = _opt(200, "diagnose a stall: a loss flat over this many optimizer steps that has not "
                                 "fallen from its start (0: off)", int)
    flat_loss_tolerance: float = _opt(0.01, "flat: the mean loss of the window's second half differs from the first "
                                      "half's by less than this fraction", float)
    label_probe_samples: int = _opt(2048, "classification: after the first step, compare the gradient on up to this "
                                    "many training rows with their labels and with them shuffled, to say at once "
                                    "when the labels do not belong to the inputs (0: off)", int)
    grad_spike_factor: float = _opt(10.0, "diagnose a gradient norm above this many times its median over the last "
                                    "100 steps (0: off)", float)



FIELDS = {f.name: f for f in fields(TrainConfig)}


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split at `sep` outside brackets: 'a=1,b=[2,3]' -> ['a=1', 'b=[2,3]']."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if depth != 0:
        raise UsageError(f"'{text}' has unbalanced brackets: write a list as key=[a,b]")
    return [*parts, current]


def _parse_kv(text: str) -> dict:
    """'a=1,b=x,c=[1,2]' -> {'a': 1, 'b': 'x', 'c': [1, 2]} with YAML typing of each value."""
    out = {}
    for item in filter(None, (s.strip() for s in split_top_level(text))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"'{item}' is not key=value: write e.g. --model_args n_layer=4,n_head=4")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise UsageError(f"'{item}': the value is not readable: write a number, a word, true/false or a list "
                             f"in brackets like [1,2]") from None
    return out


def _coerce(name: str, value: Any, where: str) -> Any:
    """Check one value against its field's type; YAML's '1e-3' (a string) becomes a float."""
    typ = FIELDS[name].metadata["type"]
    if value is None:
        if FIELDS[name].default is None:
            return None
        raise UsageError(f"{name} is empty in {where}: give a value or remove the key")
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            raise ValueError
        if typ is list:  # a YAML list, or 'a,b' from a flag
            items = value if isinstance(value, list) else str(value).split(",")
            return [str(v).strip() for v in items if str(v).strip()]
        if typ is dict:
            if isinstance(value, dict):
                return dict(value)
            return _parse_kv(str(value))
        if typ is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        if typ is int and isinstance(value, bool):
            raise ValueError
        converted = typ(value)
    except (TypeError, ValueError):
        raise UsageError(f"{name}={value!r} in {where} is not a valid {typ.__name__}: fix the value") from None
    if typ is float and not math.isfinite(converted):
        raise UsageError(f"{name}={value!r} in {where} is not a finite number: give a finite value")
    return converted


def build_parser(description: str = "") -> argparse.ArgumentParser:
    parser = Parser(description=description, argument_default=argparse.SUPPRESS,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(TrainConfig):
        meta = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text = meta["help"] if "(default:" in meta["help"] else f"{meta['help']} (default: {default})"
        metavar = "{" + ",".join(meta["choices"]) + "}" if meta["choices"] else f.name.upper()
        if meta["type"] is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, help=help_text)
        elif meta["type"] is list:
            parser.add_argument(f"--{f.name}", type=str, metavar="A,B,...", help=help_text)
        elif meta["type"] is dict:
            parser.add_argument(f"--{f.name}", type=str, metavar="K=V,...", help=help_text)
        else:
            parser.add_argument(f"--{f.name}", type=meta["type"], metavar=metavar, help=help_text)
    return parser


def load_yaml(path: str) -> dict:
    p = Path(path)
    from .preflight import checked_exists

    if not checked_exists(p, "--config") or not p.is_file():
        raise UsageError(f"config file '{path}' not found: check the path (recipe configs are in recipes/configs/)")
    try:
        data = yaml.safe_load(p.read_bytes().decode("utf-8")) or {}
    except UnicodeDecodeError as err:
        raise UsageError(f"config file '{path}' is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                         f"{err.start}): save it as UTF-8") from None
    except yaml.YAMLError as err:
        line = getattr(getattr(err, "problem_mark", None), "line", None)
        where = f" at line {line + 1}" if line is not None else ""
        raise UsageError(f"config file '{path}' is not valid YAML{where}: fix the syntax") from None
    if not isinstance(data, dict):
        raise UsageError(f"config file '{path}' must be a mapping of key: value lines")
    if "config" in data:
        raise UsageError(f"config file '{path}' has a 'config' key: a config file cannot include another; merge the "
                         f"two files or pass the other one with --config")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise UsageError(f"unknown key '{unknown[0]}' in {path}: valid keys are the flags listed by --help")
    return data


def validate(cfg: TrainConfig) -> TrainConfig:
    for name in [n for n, f in FIELDS.items() if f.metadata["choices"]]:  # YAML values bypass argparse's choices
        choices, value = FIELDS[name].metadata["choices"], getattr(cfg, name)
        if value not in choices:
            raise UsageError(f"--{name} {value!r} is not one of {', '.join(choices)}: pick one of those")
    positive = ["lr", "batch_size", "gradient_accumulation_steps", "num_epochs", "base_batch_size", "log_every",
                "init_scale", "growth_interval", "checkpoints_total_limit"]
    positive += [n for n in ("max_steps", "checkpointing_steps", "eval_steps", "eval_batch_size", "cpu_threads",
                             "peak_flops")
                 if getattr(cfg, n) is not None]
    for name in positive:
        if not getattr(cfg, name) > 0:
            raise UsageError(f"--{name} {getattr(cfg, name)} must be positive: give a value above 0")
    nonnegative = ["weight_decay", "warmup_steps", "max_grad_norm", "num_workers", "sample_tokens"]
    nonnegative += ["seed", "max_skipped_steps", "min_loss_scale", "flat_loss_window", "flat_loss_tolerance",
                    "grad_spike_factor", "label_probe_samples"]
    for name in nonnegative:
        if getattr(cfg, name) < 0:
            raise UsageError(f"--{name} {getattr(cfg, name)} must not be negative: give 0 or more")
    if cfg.seed >= 2**32:
        raise UsageError(f"--seed {cfg.seed} is beyond the 32-bit seeds numpy and torch take: give 0 to {2**32 - 1}")
    if cfg.lr > MAX_LR:
        raise UsageError(f"--lr {cfg.lr:g} is above {MAX_LR:g}: AdamW moves every weight by about lr per step, so "
                         f"training would diverge at once; give e.g. 1e-3")
    if cfg.cpu_threads is not None and cfg.cpu_threads > usable_cores():
        raise UsageError(f"--cpu_threads {cfg.cpu_threads} is more than the {usable_cores()} usable cores of this "
                         f"machine (threads beyond cores slow every step): give at most {usable_cores()}")
    if cfg.flat_loss_window == 1:
        raise UsageError("--flat_loss_window 1 has no halves to compare: give 0 (off) or 2 or more")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise UsageError(f"--min_lr_ratio {cfg.min_lr_ratio} must be between 0 and 1")
    if not cfg.project or len(cfg.project) > 128 or any(c in cfg.project for c in "/\\#?%:"):
        raise UsageError(f"--project {cfg.project!r} is not a valid W&B project name: use 1-128 characters "
                         f"without / \\ # ? % :")
    for tag in cfg.tags:
        if len(tag) > 64:
            raise UsageError(f"--tags: {tag!r} is longer than W&B's 64 characters: shorten it")
    from .resume import CHANGEABLE

    for name in cfg.allow_config_change:
        if name not in CHANGEABLE:
            raise UsageError(f"--allow_config_change {name}: only {', '.join(CHANGEABLE)} can change within a run")
    if cfg.allow_config_change and not cfg.resume_from_checkpoint:
        raise UsageError("--allow_config_change is for resuming (with --resume_from_checkpoint): drop it")
    if cfg.resume_from_checkpoint == "latest" and cfg.output_dir is None:
        raise UsageError("--resume_from_checkpoint latest needs --output_dir: the run folder to resume")
    from .models import hf_flags

    hf_flags.check(cfg)  # --model_name_or_path and friends: the folders are read at the start of the run
    return cfg


def parse_config(argv: list[str] | None = None, description: str = "") -> TrainConfig:
    """Defaults < YAML < flags, then validate, then the transformers flags resolved (mixprec.models.hf_flags.apply:
    their folders are read here). The result is frozen. Raises UsageError on bad input."""
    parser = build_parser(description)
    args = vars(parser.parse_args(sys.argv[1:] if argv is None else argv))
    from . import run_settings

    taken = run_settings.recorded(args)  # a resume: the run's own settings, below a --config file and the flags
    values: dict[str, Any] = {k: _coerce(k, v, "the run's config.yaml") for k, v in taken.items() if k in FIELDS}
    if taken:
        defaults = dataclasses.asdict(TrainConfig())
        run_settings.say({k: values[k] for k in values}, defaults, Path(args["output_dir"]) / "config.yaml")
    given = set(args)  # typed or in the --config file, not the defaults nor a resumed run's record (`set_by_user`;
    # mixprec.models.hf_flags and lora, which this module imports, read cfg._given themselves)
    if args.get("config"):
        yaml_values = load_yaml(args["config"])
        values.update({k: _coerce(k, v, args["config"]) for k, v in yaml_values.items()})
        given |= set(yaml_values) | {f"{k}.{sub}" for k, v in yaml_values.items() if isinstance(v, dict) for sub in v}
    for key, value in args.items():
        if FIELDS[key].metadata["type"] is dict:
            given |= {f"{key}.{sub}" for sub in _parse_kv(value)}
            value = {**values.get(key, {}), **_parse_kv(value)}  # flags add to the YAML's settings
        values[key] = _coerce(key, value, "the command line") if key != "config" else value
    cfg = TrainConfig(**values)
    object.__setattr__(cfg, "_given", frozenset(given))  # frozen: set once, here
    return resolve(validate(cfg))


def resolve(cfg: TrainConfig) -> TrainConfig:
    """The settings with those the transformers flags set (mixprec.models.hf_flags.apply: --model_name_or_path
    makes --model hf_causal_lm, its model_args and the tokenizer's dataset_args; the model's folders are read
    here), once: `cfg` itself when resolved already or when no transformers model is asked for."""
    from .models import hf_flags

    if cfg._hf_resolved:
        return cfg
    resolved = replace(cfg, **hf_flags.apply(cfg))
    object.__setattr__(resolved, "_hf_resolved", True)
    return resolved


def replace(cfg: TrainConfig, **changes) -> TrainConfig:
    """`dataclasses.replace` (a TrainConfig is frozen once parsed), keeping parse_config's record of where each
    setting came from (`set_by_user`); to be resolved again (`resolve`)."""
    new = dataclasses.replace(cfg, **changes)
    object.__setattr__(new, "_given", cfg._given)
    return new


def set_by_user(cfg: TrainConfig, name: str) -> bool | None:
    """Whether setting `name` ('dataset_args.block_size': one key of a dict setting) was typed or is in the --config
    file; None for a TrainConfig that parse_config did not make (where a setting came from is not known)."""
    given = cfg._given
    return None if given is None else name in given


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


SECTIONS = {"config": "What to train", "mixed_precision": "Precision", "batch_size": "Batch and optimisation",
            "output_dir": "Run folder, checkpoints, logging", "dataset_name": "Data at scale and speed options",
            "report_to": "Experiment tracking", "health_checks": "Health checks"}  # a section starts at each key


def _type_name(meta: dict) -> str:
    if meta["choices"]:
        return " / ".join(f"`{c}`" for c in meta["choices"])
    return {list: "list", dict: "key=value list", bool: "flag (--name / --no-name)"}.get(meta["type"],
                                                                                     meta["type"].__name__)


def reference_markdown() -> str:
    """docs/configuration.md: every setting, from the same metadata as --help (`python -m mixprec.config`)."""
    lines = ["# Configuration reference", "",
             "Generated from `mixprec.config.TrainConfig` by `python -m mixprec.config > docs/configuration.md`; "
             "tests/test_docs.py keeps it equal to that and to `python recipes/train.py --help`.", "",
             "Settings come from the built-in defaults, then a YAML file (`--config`, e.g. "
             "`recipes/configs/gpt_tiny.yaml`), then flags. Each setting is a flag (`--batch_size 64`) and a YAML "
             "key (`batch_size: 64`). A list is `a,b` on the command line and a YAML list in a file; "
             "`--model_args` and `--dataset_args` take `key=value,key=value`, with lists in brackets "
             "(`hidden=[512,256]`). Every value is checked before anything is written: a bad one is one line and "
             "exit code 2."]
    for f in fields(TrainConfig):
        if f.name in SECTIONS:
            lines += ["", f"## {SECTIONS[f.name]}", "", "| setting | type | default | meaning |", "|---|---|---|---|"]
        meta = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        help_text, _, given = meta["help"].partition(" (default: ")
        shown = given.removesuffix(")") if given else ("none" if default is None else str(default))
        lines.append(f"| `--{f.name}` | {_type_name(meta)} | {shown} | {help_text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
