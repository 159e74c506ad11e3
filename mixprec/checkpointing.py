"""Run folders and checkpoints that survive a crash.

A run folder holds config.yaml, metrics.jsonl, summary.json, model.safetensors and checkpoints/.
A checkpoint is `accelerator.save_state` (model, optimizer, scheduler, GradScaler, RNG states) plus
trainer_state.json (step, epoch, position in the data, counters). It is written to a hidden
temporary folder, renamed into place, and only then named in `checkpoints/latest`: a crash while
saving leaves the previous checkpoint as the latest one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from accelerate.utils import broadcast_object_list

from . import faults
from .errors import UsageError

STATE_FILE = "trainer_state.json"
RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "config.yaml", "model.safetensors", "metrics.png",
             "tensorboard", "wandb")
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps taken (skipped ones included)
    epoch: int = 0  # epoch in progress
    batches_done: int = 0  # micro-batches of `epoch` already trained on
    skipped_steps: int = 0  # optimizer steps the GradScaler skipped
    window_loss_sum: float = 0.0  # the open logging window, so that a resumed run logs the same losses
    window_batches: int = 0
    extra: dict = field(default_factory=dict)  # e.g. the tracker's run id


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def default_output_dir(cfg) -> Path:
    """runs/<model>-<dataset>-<date>-<time>, the same on every process (the main one picks it)."""
    stamp = [time.strftime("%Y%m%d-%H%M%S")]
    broadcast_object_list(stamp)
    return Path("runs") / f"{cfg.model}-{cfg.dataset}-{stamp[0]}"


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under `root` (checkpoints/), or None."""
    pointer = root / "latest"
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if (named / STATE_FILE).is_file():
            return named
    complete = [(int(m.group(1)), p) for p in root.glob("step_*")
                if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return max(complete)[1] if complete else None


def open_run(cfg, out: Path, accelerator) -> Path | None:
    """Check `out` before anything is written. Returns the checkpoint to resume from, or None.

    Refuses (UsageError) to write over another run unless told to resume it or to overwrite it.
    """
    resume, found = cfg.resume_from_checkpoint, None
    if resume == "latest":
        found = latest(out / "checkpoints")
        if found is None:
            if accelerator.is_main_process:
                print(f"resume: no checkpoint in {out / 'checkpoints'}, starting from step 0", flush=True)
        return found  # continuing this folder's run, with or without a checkpoint
    if resume:
        path = Path(resume)
        if not path.exists():
            raise UsageError(f"--resume_from_checkpoint '{resume}' does not exist: give a checkpoint folder "
                             f"(runs/NAME/checkpoints/step_N) or 'latest' with --output_dir")
        found = latest(path / "checkpoints") if (path / "checkpoints").is_dir() else path
        if found is None or not (found / STATE_FILE).is_file():
            raise UsageError(f"--resume_from_checkpoint '{resume}' is not a complete checkpoint "
                             f"(no {STATE_FILE} in it): give a checkpoints/step_N folder")
        if out.resolve() in found.resolve().parents:
            return found  # continuing this folder's own run
    existing = [name for name in RUN_FILES[:3] if (out / name).exists()]
    if existing and not cfg.overwrite_output_dir:
        raise UsageError(f"--output_dir '{out}' already holds a run ({existing[0]}): pass --resume_from_checkpoint "
                         f"latest to continue it, --overwrite_output_dir to replace it, or choose another folder")
    accelerator.wait_for_everyone()  # every process has looked before anything is removed
    if existing and accelerator.is_main_process:
        for name in RUN_FILES:
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    accelerator.wait_for_everyone()
    return found


def load(accelerator, path: Path) -> TrainerState:
    accelerator.load_state(str(path))
    state = json.loads((path / STATE_FILE).read_text())
    return TrainerState(**state)


def save(accelerator, out: Path, state: TrainerState, keep: int) -> Path:
    """Save a checkpoint for `state.step` (every process must call this)."""
    root = out / "checkpoints"
    name = f"step_{state.step:07d}"
    tmp, final = root / f".tmp-{name}", root / name
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_atomic(tmp / STATE_FILE, json.dumps(asdict(state), indent=1))
        faults.maybe_kill("kill_during_save", state.step)  # tests: a crash between writing and publishing
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_atomic(root / "latest", name)
        _prune(root, keep)
    accelerator.wait_for_everyone()
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted((int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name)))
    for _, path in done[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    for stale in root.glob(".tmp-step_*"):  # left by a crash while saving
        shutil.rmtree(stale, ignore_errors=True)
