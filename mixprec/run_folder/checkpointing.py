"""Checkpoints whose integrity is known.

A checkpoint is `accelerator.save_state` (model, optimizer, GradScaler, RNG states, the learning-rate
schedule) plus trainer_state.json (step, position in the data, counters, the settings that define the run).
It is written to a hidden temporary folder `checkpoints/.tmp-step_N`. Once every process has written its
files, the main process fsyncs each of them, writes manifest.json last (every file's name, size and sha256),
fsyncs the folder, renames it to `step_N`, fsyncs `checkpoints/`, and only then names it in
`checkpoints/latest`. A crash at any moment leaves the previous checkpoint as the latest complete one.

On resume, `find` checks checkpoints against their manifests, newest first: one that fails (a file missing,
cut short or changed, no manifest at all) is reported in one line and the next older one is tried.

A disk that refuses a write while saving (full, read-only, no permission) is a `StorageError` (one line:
the path, the space needed and free, the fix; exit code 74): the temporary folder is removed and the
previous checkpoint stays `latest`, resumable in place. Something of the wrong kind where a checkpoint goes
(`latest` a folder, a `step_N` a file: `in_the_way`) is named as such, not as a disk problem; the run folder
refuses it at start (mixprec.run_folder.rundir).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import compat
from ..errors import StorageError, name_the_file

STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps taken (skipped ones included)
    epoch: int = 0  # epoch in progress
    batches_done: int = 0  # micro-batches of `epoch` already trained on, per process
    schedule_steps: int = 0  # the length of the learning-rate schedule
    layout: dict = field(default_factory=dict)  # batch_size, accumulation, world_size, samples_per_step
    settings: dict = field(default_factory=dict)  # what defines the run's trajectory (mixprec.run_folder.resume)
    extra: dict = field(default_factory=dict)  # the tracker's run id; the health watch and the open log window


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write `path` whole or not at all: through `.NAME.tmp`, which no failure leaves behind."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        name_the_file(err, path)
        raise


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path) -> None:
    """fsync every file of `folder`, then write its manifest last, then fsync the folder."""
    compat.umask_modes(folder)  # safetensors' files: readable as the umask says, as every other file
    entries = {}
    for path in _files(folder):
        fsync_path(path)
        entries[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": sha256(path)}
    write_atomic(folder / MANIFEST, json.dumps({"files": entries}, indent=1) + "\n")
    for sub in sorted({p.parent for p in _files(folder)} | {folder}, reverse=True):
        fsync_path(sub)


def verify(folder: Path) -> str | None:
    """None when `folder` is a complete checkpoint whose files match its manifest; else what is wrong."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST} (cut short while saving, or written by an older mixprec)"
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is not readable"
    for name, expected in entries.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{name} has {size:,} bytes, not {expected['size']:,}"
        if sha256(path) != expected["sha256"]:
            return f"{name} is changed (checksum differs)"
    try:
        TrainerState(**json.loads((folder / STATE_FILE).read_text()))
    except (OSError, ValueError, TypeError) as err:
        return f"{STATE_FILE} is not readable ({type(err).__name__})"
    return None


def step_folders(root: Path) -> list[Path]:
    """checkpoints/step_N folders, newest first."""
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def find(root: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under `root` (checkpoints/) that passes its manifest, and one line for each newer
    one that does not."""
    problems = []
    for folder in step_folders(root):
        problem = verify(folder)
        if problem is None:
            return folder, problems
        problems.append(f"checkpoint {folder} is damaged: {problem}")
    return None, problems


def load_state(path: Path) -> TrainerState:
    return TrainerState(**json.loads((path / STATE_FILE).read_text()))


def remove_temporary(root: Path) -> None:
    """Temporary folders left by a crash while saving."""
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)


def _size(folder: Path | None) -> int:
    return sum(p.stat().st_size for p in _files(folder)) if folder and folder.is_dir() else 0


def _storage_error(what: str, tmp: Path, root: Path, previous: Path | None) -> StorageError:
    need, free = _size(previous), shutil.disk_usage(root).free if root.exists() else 0
    need_text = f"about {need / 2**20:,.1f} MB (the size of the previous checkpoint)" if need else "an unknown amount"
    return StorageError(
        f"could not save checkpoint {tmp.name.removeprefix('.tmp-')} in {root}: {what}; it needs {need_text} "
        f"and {free / 2**20:,.1f} MB is free there: free space or make "
        f"the folder writable, then continue with --resume_from_checkpoint latest ({_kept(previous)})")


def _kept(previous: Path | None) -> str:
    return f"{previous.name} stays the latest checkpoint" if previous else "no earlier checkpoint exists"


def in_the_way(root: Path) -> str | None:
    """What under `root` (checkpoints/) is of the wrong kind for mixprec to use: `latest` a folder, a
    `step_N` a file. None when nothing is."""
    if root.exists() and not root.is_dir():
        return f"'{root}' is a file, where mixprec keeps the checkpoint folders"
    if not root.is_dir():
        return None
    latest = root / "latest"
    if latest.exists() and not latest.is_file():
        return f"'{latest}' is a folder, where mixprec keeps a file naming the latest checkpoint"
    stray = next((p for p in sorted(root.glob("step_*")) if _STEP_DIR.match(p.name) and not p.is_dir()), None)
    return f"'{stray}' is a file, where mixprec keeps a checkpoint folder" if stray else None


def save(accelerator, out: Path, state: TrainerState, keep: int) -> Path:
    """Save a checkpoint for `state.step` (every process calls this)."""
    root = out / "checkpoints"
    name = f"step_{state.step:07d}"
    tmp, final = root / f".tmp-{name}", root / name
    previous = step_folders(root)[0] if root.is_dir() and step_folders(root) else None
    failure: str | None = None
    try:
        if accelerator.is_main_process:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        if accelerator.is_main_process:
            write_atomic(tmp / STATE_FILE, json.dumps(asdict(state), indent=1))
    except BaseException as err:  # a refused write, reported by whichever serializer ran
        failure = compat.storage_failure(err) if isinstance(err, Exception) else None
        if failure is None:
            if accelerator.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    if _any_failed(accelerator, failure is not None):
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _storage_error(failure or "another process could not write its files", tmp, root, previous)
    if accelerator.is_main_process:
        try:
            write_manifest(tmp)
            _publish(tmp, final, root, name)
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            wrong = in_the_way(root)
            if wrong:  # not the disk: something of the wrong kind where the checkpoint goes
                raise StorageError(f"could not save checkpoint {name}: {wrong}: move it away, then continue "
                                   f"with --resume_from_checkpoint latest ({_kept(previous)})") from None
            raise _storage_error(compat.storage_failure(err), tmp, root, previous) from None
        prune(root, keep)
    accelerator.wait_for_everyone()
    return final


def _any_failed(accelerator, failed: bool) -> bool:
    if accelerator.num_processes == 1:
        return failed
    import torch

    flag = torch.tensor([float(failed)], device=accelerator.device)
    return accelerator.reduce(flag, "sum").item() > 0


def _publish(tmp: Path, final: Path, root: Path, name: str) -> None:
    """Rename the finished temporary folder into place, then point `latest` at it."""
    if final.is_dir():
        shutil.rmtree(final)
    os.replace(tmp, final)  # over a file of that name: NotADirectoryError, reported by `save`
    fsync_path(root)
    write_atomic(root / "latest", name)
    fsync_path(root)


def prune(root: Path, keep: int) -> None:
    for path in step_folders(root)[keep:]:
        shutil.rmtree(path, ignore_errors=True)
    remove_temporary(root)
