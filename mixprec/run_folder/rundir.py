"""The run folder is the user's data: nothing in it is created, changed or removed before the run is known
to start.

`inspect` only reads: it refuses an --output_dir that is a file, or not writable, or that holds another run
(unless told to resume or overwrite it), or a saved model, tokenizer, adapter or dataset instead of a run
(mixprec.run_folder.sources.foreign; never, whatever the flags), or that another run is using now, or whose checkpoints/
holds something of the wrong kind (`latest` a folder, a `step_N` a file), or whose export folders (hf_model/,
adapter/) hold a file or a folder without mixprec_export.json (models.hf_export.EXPORT_MARK: the user's, not an
export of this recipe); it finds the checkpoint to resume.
The recipe then checks its settings, data, model and the resume contract, and only then calls `open`:

1. the lock: `fcntl.flock` on `<output_dir>/.lock`, held while the run lives and released by the kernel when
   the process ends, however it ends (a SIGKILL never leaves a stale lock). A second run on the same folder
   stops with one line naming the process holding it (exit code 2). With several processes, the main
   process holds it. A requeued SLURM job finds the lock free: its predecessor has ended;
2. then, with --overwrite_output_dir, the old run's files are removed, its exports included, so that the folder
   holds the new run alone; a crash's temporary checkpoint folders and an old preempted.json are cleared;
3. config.yaml is written: the settings in effect, what really runs (`effective`), derived numbers, and
   `history`: one entry per start or resume (when, from which checkpoint and step, what changed).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from . import checkpointing, sources
from .. import preflight
from .checkpointing import write_atomic
from ..errors import UsageError

if TYPE_CHECKING:
    from ..config.sections import RunFolderSettings

LOCK = ".lock"
RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "config.yaml", "model.safetensors", "metrics.png",
             "sample.txt", "preempted.json", "tensorboard", "wandb")
HOLDS_A_RUN = RUN_FILES[:3]
EXPORTS = ("hf_model", "adapter")  # the transformers export and the LoRA adapter (mixprec.models)


def _holder(out: Path) -> str | None:
    """Who holds the folder's lock now (its pid and command), or None. Creates nothing."""
    path = out / LOCK
    if not path.is_file():
        return None
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "another process"
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def _check_writable(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output_dir '{out}' is a file, not a folder: choose another --output_dir")
    probe = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"--output_dir '{out}' cannot be written ('{probe}' is not a writable folder): "
                         f"choose another --output_dir or fix its permissions")


def inspect(run_folder: RunFolderSettings, out: Path) -> tuple[Path | None, list[str]]:
    """Read-only checks of the run folder; returns the checkpoint to resume from (or None) and one line for
    each damaged checkpoint passed over."""
    preflight.path_names(out, "--output_dir")
    preflight.checked_exists(out, "--output_dir")  # a loop of links, a part that is a file: said as what to do
    _check_writable(out)
    saved = sources.foreign(out)
    if saved:
        raise UsageError(f"--output_dir '{out}' holds a saved model, tokenizer, adapter or dataset ({saved}), not a "
                         f"run of this recipe: it is never written or emptied; choose another --output_dir")
    _check_exports(out)
    holder = _holder(out)
    if holder:
        raise UsageError(f"--output_dir '{out}' is in use by another run ({holder}): wait for it to end, or "
                         f"choose another --output_dir")
    resume, found, problems = run_folder.resume_from_checkpoint, None, []
    wrong = None if run_folder.overwrite_output_dir else checkpointing.in_the_way(out / "checkpoints")
    if wrong:
        raise UsageError(f"--output_dir '{out}' cannot take checkpoints: {wrong}: move it away, or choose "
                         f"another --output_dir")
    if resume == "latest":
        root = out / "checkpoints"
        found, problems = checkpointing.find(root) if root.is_dir() else (None, [])
        if found is None and problems:
            raise UsageError(f"no checkpoint in {root} passes its manifest ({problems[0].split(': ', 1)[1]}"
                             f"{' and more' if len(problems) > 1 else ''}): start a new --output_dir")
        return _not_replaced(run_folder, out, found), problems
    if resume:
        found, problems = _explicit(Path(resume))
        if out.resolve() in found.resolve().parents:
            return _not_replaced(run_folder, out, found), problems  # continuing this folder's own run
    existing = [name for name in HOLDS_A_RUN if (out / name).exists()]
    if existing and not run_folder.overwrite_output_dir:
        raise UsageError(f"--output_dir '{out}' already holds a run ({existing[0]}): pass --resume_from_checkpoint "
                         f"latest to continue it, --overwrite_output_dir to replace it, or choose another folder")
    return found, problems


def ours(folder: Path) -> bool:
    """Whether an export folder was written by this recipe: it holds EXPORT_MARK. (An export from before the mark
    is refused like a user's folder: its summary.json naming it proves nothing once someone has put their own
    model in its place.)"""
    from ..models.hf_export import EXPORT_MARK

    return (folder / EXPORT_MARK).is_file()


def _check_exports(out: Path) -> None:
    """Where the run puts its exports (hf_model/, adapter/) holds nothing, or an export this recipe wrote (which
    the run's end replaces whole); a file or a folder of the user's is refused now, not after training."""
    for name in EXPORTS:
        folder = out / name
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            raise UsageError(f"--output_dir '{out}': '{folder}' is {'a link' if folder.is_symlink() else 'a file'} "
                             f"where the run writes its {name}/ export: move it away, or choose another --output_dir")
        if folder.is_dir() and not ours(folder):
            raise UsageError(f"--output_dir '{out}': '{folder}' is a folder this recipe did not write (no "
                             f"mixprec_export.json), where the run writes its {name}/ export: move it away, or choose "
                             f"another --output_dir")


def _not_replaced(cfg: RunFolderSettings, out: Path, found: Path | None) -> Path | None:
    """A resume of this folder's own run cannot also replace that run (--overwrite_output_dir would remove the
    checkpoint it resumes from)."""
    if found is not None and cfg.overwrite_output_dir:
        raise UsageError(f"--resume_from_checkpoint continues the run in '{out}' and --overwrite_output_dir would "
                         f"remove it first: drop --overwrite_output_dir to continue it, or drop "
                         f"--resume_from_checkpoint to start over")
    return found


def _explicit(path: Path) -> tuple[Path, list[str]]:
    if not preflight.checked_exists(path, "--resume_from_checkpoint"):
        raise UsageError(f"--resume_from_checkpoint '{path}' does not exist: give a checkpoint folder "
                         f"(runs/NAME/checkpoints/step_N), a run folder, or 'latest' with --output_dir")
    if (path / "checkpoints").is_dir():
        found, problems = checkpointing.find(path / "checkpoints")
        if found is None:
            raise UsageError(f"--resume_from_checkpoint '{path}' holds no complete checkpoint"
                             f"{': ' + problems[0] if problems else ''}: give a checkpoints/step_N folder")
        return found, problems
    problem = checkpointing.verify(path)
    if problem:
        raise UsageError(f"--resume_from_checkpoint '{path}' is not a complete checkpoint ({problem}): give "
                         f"another checkpoints/step_N folder")
    return path, []


class RunFolder:
    """The open run folder (see the module docstring); `close` releases the lock."""

    def __init__(self, out: Path, accelerator):
        self.out, self.accelerator, self._lock = out, accelerator, None

    def open(self, overwrite: bool) -> None:
        from accelerate.utils import broadcast_object_list

        error = [None]
        if self.accelerator.is_main_process:
            try:
                self._take_lock()
                self._clear(overwrite)
            except UsageError as err:
                error[0] = str(err)
            except OSError as err:
                error[0] = str(preflight.explain(err, "--output_dir", err.filename or self.out))
        if self.accelerator.num_processes > 1:
            broadcast_object_list(error)
        if error[0]:
            raise UsageError(error[0])

    def _take_lock(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        f = open(self.out / LOCK, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise UsageError(f"--output_dir '{self.out}' is in use by another run ({holder}): wait for it to end, "
                             f"or choose another --output_dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {os.uname().nodename}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        self._lock = f

    def _clear(self, overwrite: bool) -> None:
        if overwrite:  # the previous run's files, its exports (this recipe's: checked by inspect) and their leftovers
            hidden = [f".{n}.{end}" for n in EXPORTS for end in ("tmp", "old")]
            for name in (*RUN_FILES, *EXPORTS, *hidden):
                target = self.out / name
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
        checkpointing.remove_temporary(self.out / "checkpoints")
        (self.out / "preempted.json").unlink(missing_ok=True)

    def write_config(self, run_info: dict, entry: dict) -> None:
        """config.yaml: `run_info` (the settings in effect now) and the history with `entry` appended."""
        if not self.accelerator.is_main_process:
            return
        path = self.out / "config.yaml"
        history = []
        if path.is_file() and entry.get("event") == "resumed":
            try:
                history = list((yaml.safe_load(path.read_text()) or {}).get("history") or [])
            except (yaml.YAMLError, UnicodeDecodeError, AttributeError, TypeError):
                history = []
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **entry}
        write_atomic(path, yaml.safe_dump({**run_info, "history": [*history, entry]}, sort_keys=False))

    def amend_config(self, effective: dict, entry: dict) -> None:
        """config.yaml after a change during the run: `effective`'s keys replace those of its effective settings
        and `entry` is appended to its history."""
        if not self.accelerator.is_main_process:
            return
        path = self.out / "config.yaml"
        record = yaml.safe_load(path.read_text())
        record["effective"].update(effective)
        record["history"].append({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **entry})
        write_atomic(path, yaml.safe_dump(record, sort_keys=False))

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None
