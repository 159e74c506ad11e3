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
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from . import hints, sections
from .arg_parser import Parser
from ..errors import UsageError
from ..devices.threads import usable_cores

from .sections import (DataSettings, HealthSettings, LoraSettings, ModelSettings, OptimSettings, PrecisionSettings,
                       RunFolderSettings, SpeedSettings, TrackingSettings)
MAX_LR = 1.0  # AdamW: a step moves each weight by up to about lr


@dataclass(frozen=True)
class TrainConfig(HealthSettings, TrackingSettings, SpeedSettings, RunFolderSettings, OptimSettings, PrecisionSettings,
                  DataSettings, LoraSettings, ModelSettings):
    """Every setting, flat (the sections of mixprec.config.sections in reverse: a dataclass takes its bases' fields
    from the last base on, so the fields come in sections.ALL's order)."""

    _given = None  # not a setting: parse_config's record of what was typed or in the --config file (set_by_user)
    _hf_resolved = False  # not a setting: the transformers flags resolved into the settings (`resolve`)

    # the sections, for the modules that read one (the model's is ModelSettings.of(cfg): `model` is a setting)
    lora = property(LoraSettings.of)
    data = property(DataSettings.of)
    precision = property(PrecisionSettings.of)
    optim = property(OptimSettings.of)
    run_folder = property(RunFolderSettings.of)
    speed = property(SpeedSettings.of)
    tracking = property(TrackingSettings.of)
    health = property(HealthSettings.of)


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
    for section in sections.ALL:  # --help lists the settings by section
        group = parser.add_argument_group(section.title.lower())
        for f in fields(section):
            meta = f.metadata
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            help_text = meta["help"] if "(default:" in meta["help"] else f"{meta['help']} (default: {default})"
            metavar = "{" + ",".join(meta["choices"]) + "}" if meta["choices"] else f.name.upper()
            if meta["type"] is bool:
                group.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, help=help_text)
            elif meta["type"] is list:
                group.add_argument(f"--{f.name}", type=str, metavar="A,B,...", help=help_text)
            elif meta["type"] is dict:
                group.add_argument(f"--{f.name}", type=str, metavar="K=V,...", help=help_text)
            else:
                group.add_argument(f"--{f.name}", type=meta["type"], metavar=metavar, help=help_text)
    return parser


def load_yaml(path: str) -> dict:
    p = Path(path)
    from ..preflight import checked_exists

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
    if unknown:  # keys of transformers' or TRL's are answered with the recipe's (mixprec.config.hints)
        raise UsageError(hints.config_keys(path, unknown, data))
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
    for name in FIELDS:  # what torch, numpy and the standard library take as a size or a count
        value = getattr(cfg, name)
        if type(value) is int and not -2**63 <= value < 2**63:
            raise UsageError(f"--{name} {value} does not fit in a 64-bit integer: give a value below 2**63")
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
    from .sections import CHANGEABLE

    for name in cfg.allow_config_change:
        if name not in CHANGEABLE:
            raise UsageError(f"--allow_config_change {name}: only {', '.join(CHANGEABLE)} can change within a run")
    if cfg.allow_config_change and not cfg.resume_from_checkpoint:
        raise UsageError("--allow_config_change is for resuming (with --resume_from_checkpoint): drop it")
    if cfg.resume_from_checkpoint == "latest" and cfg.output_dir is None:
        raise UsageError("--resume_from_checkpoint latest needs --output_dir: the run folder to resume")
    from ..models import hf_flags

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
    from ..models import hf_flags

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
             "(`hidden=[512,256]`). A flag of type flag is `--name` or `--no-name`, or, as transformers' HfArgumentParser "
             "takes it, `--name false` / `--name=True`. Every value is checked before anything is written: a bad one is one line and "
             "exit code 2. The sections are mixprec.config.sections' dataclasses: each module is given the ones it "
             "reads."]
    for section in sections.ALL:
        lines += ["", f"## {section.title}", "", section.__doc__, "", "| setting | type | default | meaning |",
                  "|---|---|---|---|"]
        lines += [_reference_row(f) for f in fields(section)]
    lines += ["", *hints.markdown()]  # their flags and ours: from the parser's own table
    return "\n".join(lines) + "\n"


def _reference_row(f) -> str:
    meta = f.metadata
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    help_text, _, given = meta["help"].partition(" (default: ")
    shown = given.removesuffix(")") if given else ("none" if default is None else str(default))
    return f"| `--{f.name}` | {_type_name(meta)} | {shown} | {help_text} |"
