"""The run's record: metrics.jsonl (one JSON object per logged step or evaluation), config.yaml, summary.json,
metrics.png; and the Recorder, which also feeds the trackers chosen with --report_to."""
from __future__ import annotations

import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from ..run_folder.checkpointing import write_atomic
from .jsonl import clean, read_lines, unclean
from .plot_process import PlotProcess, error_of
from .trackers import Guarded, WandB, say, tracker_values, warn

if TYPE_CHECKING:
    from ..config.sections import TrackingSettings

PACKAGES = ("torch", "accelerate", "datasets", "transformers", "deepspeed", "wandb", "tensorboard", "numpy",
            "matplotlib")


def written_at(record: dict) -> int:
    """The step a record was written on, the trackers' x for it: its `step`, or `reported_at` for an event said
    after the step it is about (a spike, judged by the losses after it; W&B drops a step it has passed)."""
    return record.get("reported_at", record["step"])


class MetricsLog:
    """Appends records to metrics.jsonl on the main process. On resume, records after the checkpoint's
    step (written by the run that crashed) are dropped first, so the file reads like one run; `kept` holds
    the records before it."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None = None):
        self.path, self.enabled, self.file, self.kept = path, enabled, None, []
        if not enabled:
            return
        lines, unreadable = [], 0
        if resume_step is not None and path.exists():
            text, unreadable = read_lines(path)
            for line in text:
                try:
                    record = json.loads(line)
                    if written_at(record) <= resume_step:
                        lines.append(line)
                        self.kept.append({k: unclean(v) for k, v in record.items()})
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by the crash
        if unreadable:
            warn(f"resume: passed over {unreadable} line{'s' if unreadable > 1 else ''} of {path} that "
                 f"{'are' if unreadable > 1 else 'is'} not UTF-8 text (left by a crash or a disk); the records up "
                 f"to step {resume_step} are kept")
        write_atomic(path, "".join(line + "\n" for line in lines))
        self.file = open(path, "a")

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps({k: clean(v) for k, v in record.items()}) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


class Recorder:
    """Where the loop sends what it measures: metrics.jsonl (the record) and the trackers of --report_to
    (through Accelerate); at the end summary.json and metrics.png. Only the global main process writes.

    `run_info` is the config logged at the start (as in config.yaml). `resume_from` and `state`: the
    checkpoint a resumed run was loaded from and its TrainerState; resuming in the same folder continues
    the same W&B run (its id is in `state.extra`), and drops records written after the checkpoint.
    """

    def __init__(self, out: Path, accelerator, tracking: TrackingSettings | None = None, run_info: dict | None = None,
                 resume_from: Path | None = None, state=None, plotter: PlotProcess | None = None):
        self.out, self.accelerator = out, accelerator
        resume_step = state.step if resume_from is not None else None
        self.jsonl = MetricsLog(out / "metrics.jsonl", accelerator.is_main_process, resume_step)
        same_run = resume_from is not None and out.resolve() in Path(resume_from).resolve().parents
        self.extra = dict(state.extra.get("tracking", {})) if same_run else {}
        trackers = [t for t in getattr(accelerator, "log_with", []) if isinstance(t, Guarded)]
        if tracking is not None and trackers:
            for tracker in trackers:
                tracker.bind(out, resume_step if same_run else None, self.extra)
            accelerator.init_trackers(tracking.project, config=run_info or {})  # the main process only
            if same_run:
                self._resend(self.jsonl.kept)
        self.plotter = plotter  # metrics.png's helper process (mixprec.tracking.plot_process), main process only

    def _resend(self, records: list[dict]) -> None:
        """W&B writes its run file every 15 s, so a job killed soon after a checkpoint may have lost steps that
        the checkpoint covers. The resumed job sends W&B the record up to the checkpoint again, from
        metrics.jsonl: an offline piece then holds the whole run, and a resumed online run skips the steps
        it already has. (TensorBoard writes each step at once: nothing to send again.)"""
        for tracker in self.accelerator.trackers:
            if isinstance(tracker, WandB):
                for record in records:
                    tracker.log(tracker_values(record), step=written_at(record))

    def log(self, record: dict) -> None:
        """One optimizer step's metrics, one evaluation, or one health event (all carry `step`)."""
        self.jsonl.write(record)
        if self.accelerator.trackers:  # only the main process has them
            self.accelerator.log(tracker_values(record), step=written_at(record))

    def checkpoint_state(self) -> dict:
        """What a checkpoint must remember for the record to continue after a resume: the W&B run id."""
        for tracker in self.accelerator.trackers:
            if isinstance(tracker, WandB) and tracker.run_id:
                self.extra["wandb_run_id"] = tracker.run_id
        return {"tracking": dict(self.extra)}  # always: a run forked from another's checkpoint drops its id

    def finish(self, summary: dict) -> None:
        """summary.json, the summary in the trackers, and metrics.png. The trackers themselves are finished
        by `accelerator.end_training()`."""
        self.jsonl.close()
        if not self.accelerator.is_main_process:
            return
        write_json(self.out / "summary.json", summary)
        for tracker in self.accelerator.trackers:
            if isinstance(tracker, Guarded):
                tracker.store_summary(summary)
        if self.plotter is not None:  # after summary.json: a picture older than it was refused (a resume redraws)
            self.plotter.request(self.out)
        draw(self.out, self.plotter.result() if self.plotter is not None else None)

    def close(self) -> None:
        """The helper process ends (the run is over, finished or not)."""
        if self.plotter is not None:
            self.plotter.close()

    def kept(self, key: str) -> dict | None:
        """The last record kept from before a resume (main process) that holds `key`, not an event; or None."""
        return next((r for r in reversed(self.jsonl.kept) if key in r and "event" not in r), None)


def draw(out: Path, answer: dict | None = None) -> None:
    """metrics.png, or the helper process's `answer` for it (mixprec.tracking.plot_process; None: drawn here).
    A plot that fails does not fail a finished run (a warning), but a disk that refuses the write ends it like
    any other write of the record (exit code 74: mixprec.errors)."""
    from ..errors import refused_write

    try:
        if answer is None:
            from . import plots  # here, so that `python -m mixprec.tracking.plots` runs it fresh

            answer = {"path": str(plots.plot_run(out))}
        elif "error" in answer:
            raise error_of(answer)
        say(f"curves: {answer['path']}")
    except Exception as err:  # noqa: BLE001 - a plot must not fail a finished run
        if refused_write(err) is not None:
            raise
        kind = answer.get("type") if answer and "error" in answer else type(err).__name__
        warn(f"could not draw {out / 'metrics.png'} ({kind}: {err}); the numbers are in {out / 'metrics.jsonl'}")


def environment() -> dict:
    """What the run ran with: package versions, Python, the command, and the git commit of this checkout."""
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    env = {"versions": versions, "command": " ".join(sys.argv), "host": platform.node()}
    env.update(_git(Path(__file__).resolve().parents[2]))
    return env


def _git(repo: Path) -> dict:
    """{'git_commit': sha, 'git_dirty': bool} when `repo` is a git checkout, else {}."""
    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {}
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git_commit": head.stdout.strip(), "git_dirty": dirty}


def write_yaml(path: Path, data: dict) -> None:
    write_atomic(path, yaml.safe_dump(data, sort_keys=False))


def write_json(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps({k: clean(v) for k, v in data.items()}, indent=2) + "\n")
