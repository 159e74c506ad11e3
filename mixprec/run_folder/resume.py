"""The resume contract: a resumed run is the same run, or the run's record says exactly how it differs.

A checkpoint records the settings that define the run's trajectory (`trajectory`): model, data (with a
fingerprint of --train_file), the global batch, seed, precision, optimizer and schedule settings. Resuming
compares them with the settings of the new command (`compare`):

- A difference in a setting where a change is meaningful (`CHANGEABLE`: the lesson's advice after a NaN is to
  lower the learning rate and continue) is refused unless `--allow_config_change NAME,...` names it; then it
  takes effect from the resume step (`apply`) and config.yaml's history records it. Any other difference is
  refused: one line lists each changed setting as `name: old -> new`, and the fix.
- How the global batch (batch_size x gradient_accumulation_steps x processes) is split may change freely: a
  checkpoint of 2 processes of batch 16 resumes on 1 process of batch 32 at the same sample. Changing the
  global batch itself needs `--allow_config_change global_batch`.
- --max_steps / --num_epochs may change. The learning-rate schedule keeps the length it was planned with;
  steps beyond it run at its final rate (`describe_length`).
- Settings that do not change the trajectory (logging, evaluation, checkpoint frequency, trackers, health
  checks, threads, compile) may change freely.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from .. import compat
from ..config.sections import CHANGEABLE
from ..errors import UsageError

if TYPE_CHECKING:
    from ..config.sections import LoraSettings

_SMALL_FILE = 64 * 2**20  # files up to this size are fingerprinted by content, bigger ones by size and time


def fingerprint(path: str | None, flag: str = "--train_file") -> str | None:
    """What --train_file (or `flag`) is: sha256 of a small file's content; size and mtime of big files and folders."""
    if not path:
        return None
    p = Path(path).expanduser()
    from .. import preflight

    if not preflight.checked_exists(p, flag):  # a dataset that reads no file still records it
        raise UsageError(f"{flag} '{path}' not found: check the path, or drop it")
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    digest = hashlib.sha256()
    for f in files:
        stat = f.stat()
        digest.update(f"{f.relative_to(p) if p.is_dir() else f.name}:{stat.st_size}".encode())
        if stat.st_size <= _SMALL_FILE and len(files) == 1:
            digest.update(f.read_bytes())
        else:
            digest.update(str(stat.st_mtime_ns).encode())
    return f"{sum(f.stat().st_size for f in files)} bytes, sha256 {digest.hexdigest()[:16]}"


def trajectory(cfg, lr: float, samples_per_step: int, precision: str, model_args: dict, dataset_args: dict,
               sources: dict | None = None) -> dict:
    """The settings that define where training goes, as a checkpoint records them (`model_args` and
    `dataset_args` resolved: defaults and presets filled in, so that spelling out a default changes nothing), and
    `sources`: what the model's folders held (mixprec.run_folder.sources.fingerprint, compared by mixprec.run_folder.sources before
    anything loads, not here)."""
    return {"model": cfg.model, "model_args": model_args, "dataset": cfg.dataset,
            "dataset_args": dataset_args, "dataset_name": cfg.dataset_name,
            "dataset_config": cfg.dataset_config, "train_file": fingerprint(cfg.train_file),
            "validation_file": fingerprint(cfg.validation_file, "--validation_file"),
            "global_batch": samples_per_step, "seed": cfg.seed, "mixed_precision": precision, "lr": lr,
            "weight_decay": cfg.weight_decay, "warmup_steps": cfg.warmup_steps, "lr_schedule": cfg.lr_schedule,
            "min_lr_ratio": cfg.min_lr_ratio, "max_grad_norm": cfg.max_grad_norm, "init_scale": cfg.init_scale,
            "growth_interval": cfg.growth_interval, "tf32": cfg.tf32, "fp32_modules": list(cfg.fp32_modules),
            "master_weights": cfg.master_weights,
            "bf16_update": cfg.bf16_update if cfg.master_weights == "bf16" else None,
            "peft": _peft(cfg.lora), "sources": sources}


def _peft(lora: LoraSettings):
    from ..models.lora import settings

    return settings(lora)


def _same(a, b) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _with_later_keys(old, new):
    """A dict setting (model_args, dataset_args) as a checkpoint from before some key existed recorded it: a key
    added since, at None (its default: nothing set), is not a change."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {**{k: v for k, v in new.items() if k not in old and v is None}, **old}
    return old


def compare(saved: dict, now: dict, allowed: list[str], checkpoint: Path) -> dict:
    """The allowed changes {name: (old, new)}; a UsageError naming every other one."""
    saved = {"master_weights": "fp32", "bf16_update": None, "peft": None, **saved}  # checkpoints from before the setting
    saved = {k: _with_later_keys(v, now.get(k)) for k, v in saved.items()}
    changed = {k: (saved[k], now.get(k)) for k in saved
               if k in now and k != "sources" and not _same(saved[k], now[k])}
    refused = {k: v for k, v in changed.items() if k not in allowed}
    if refused:
        listed = "; ".join(f"{k}: {old} -> {new}" for k, (old, new) in refused.items())
        meaningful = [k for k in refused if k in CHANGEABLE]
        fixed = [k for k in refused if k not in CHANGEABLE]
        fix = "start a new --output_dir"
        if meaningful:
            fix += f", or pass --allow_config_change {','.join(meaningful)} to continue with the new value"
        if fixed:
            fix += f" ({', '.join(fixed)} cannot change within a run)"
        raise UsageError(f"resume: the settings differ from those of checkpoint {checkpoint}: {listed}: {fix}")
    return changed


def describe_length(step: int, total: int, schedule_steps: int, final_lr: float) -> str | None:
    """What a changed --max_steps / --num_epochs does to the schedule, or None when nothing changes."""
    if total == schedule_steps:
        return None
    if total > schedule_steps:
        return (f"the run now ends at step {total}: the learning-rate schedule keeps its {schedule_steps} steps, "
                f"and steps {max(step, schedule_steps) + 1}-{total} run at its final rate {final_lr:.3g}")
    return (f"the run now ends at step {total}, before the end of its {schedule_steps}-step learning-rate "
            f"schedule: the rate will not have decayed fully")


def apply(changes: dict, optimizer, scheduler, scaler, lr_factor) -> None:
    """Make allowed changes take effect now (after the checkpoint is loaded, which restored the old values).
    max_grad_norm and tf32 are read from the settings each step; global_batch is applied by the data position.
    `lr_factor(step)`: the new schedule's multiplier of the peak rate."""
    if "lr" in changes:
        compat.set_peak_lrs(scheduler, [changes["lr"][1]] * len(optimizer.param_groups))
    if "weight_decay" in changes:
        optimizer.param_groups[0]["weight_decay"] = changes["weight_decay"][1]
    if changes.keys() & {"lr", "warmup_steps", "lr_schedule", "min_lr_ratio"}:
        for group, base in zip(optimizer.param_groups, compat.peak_lrs(scheduler)):
            group["lr"] = base * lr_factor(scheduler.last_epoch)
    if scaler is not None and changes.keys() & {"init_scale", "growth_interval"}:
        state = scaler.state_dict()
        if "init_scale" in changes:
            state["scale"] = float(changes["init_scale"][1])
        if "growth_interval" in changes:
            state["growth_interval"] = int(changes["growth_interval"][1])
        scaler.load_state_dict(state)
