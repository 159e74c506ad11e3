"""Stopping on request: on SIGTERM, SIGHUP, SIGUSR1 or SIGINT, save a checkpoint once and exit with code 75.

SLURM sends SIGUSR1 ahead of the time limit (`#SBATCH --signal=USR1@120` in slurm/train.sbatch) and SIGTERM
when it preempts, requeues or cancels a job, then SIGKILL once the grace time is over (KillWait, 30 s by
default); torch's elastic agent (`accelerate launch` with several processes) passes SIGTERM, SIGINT and SIGHUP
on to its workers with 30 s before SIGKILL; a closed terminal or ssh session sends SIGHUP; a person presses
Ctrl-C. When `accelerate launch` itself dies, the trainer gets SIGTERM from the kernel
(`compat.stop_with_launcher`); a one-process launcher that would SIGKILL the trainer 5 s after passing a signal
on is ended first (`compat.outlive_launcher`). Whichever way it arrives:

- the handler only notes the signal. Later signals are noted too and change nothing: the checkpoint under way
  completes (SIGKILL is the way to stop at once, losing the steps since the last checkpoint);
- an output that was a terminal and is now hung up (its window or ssh session closed: SIGHUP) is pointed at
  /dev/null, so that the lines the run still prints cannot fail. A write that such a terminal refuses (EIO)
  does the same, signal or not: a line printed between the hang-up and the signal's handler, or a terminal
  closed without a signal (a process outside the terminal's session), costs that line, not the run;
- the loop asks `requested(step)` after each optimizer step. With one process that reads the flag; with
  several, the flags (one per signal) are summed over all processes every `CHECK_EVERY` steps (no collective
  on the other steps), so every process stops after the same step and knows which signal arrived;
- the loop saves a checkpoint and calls `leave`, which writes `<output_dir>/preempted.json` (the signal that
  arrived first and whether on this process or another, step, checkpoint, the signals that came later) and
  exits with code 75 (EX_TEMPFAIL: stopped on purpose, run again to continue). Launchers turn every non-zero
  code into 1: slurm/train.sbatch reads the file to requeue.

Used as a context manager: the previous handlers are back when the run returns or raises, so a recipe run
inside another program (a test) leaves its signals as they were.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from .. import compat
from .checkpointing import write_atomic

EXIT_CODE = 75  # EX_TEMPFAIL from sysexits.h
MARKER = "preempted.json"
SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
CHECK_EVERY = 10  # optimizer steps between agreements, with several processes


class Preemption:
    def __init__(self, accelerator, out: Path):
        self.accelerator, self.out = accelerator, out
        self.received: str | None = None
        self.later: list[str] = []  # signals that arrived after the first one
        self.elsewhere = False  # whether `received` arrived on another process
        self._previous: dict = {}
        self._ttys: list[int] = []
        self._undo = [lambda: None]

    def __enter__(self) -> "Preemption":
        self._ttys = [fd for fd in (1, 2) if os.isatty(fd)]
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
            self._undo.append(compat.outlive_launcher(SIGNALS))
        self._undo.append(compat.stop_with_launcher(signal.SIGTERM))
        for name in ("stdout", "stderr"):  # last: nothing after it can raise and leave them wrapped
            stream = getattr(sys, name)
            if _fileno(stream) in self._ttys:
                setattr(sys, name, _Outlives(stream, self._leave_dead_terminal))
                self._undo.append(lambda name=name, stream=stream: setattr(sys, name, stream))
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        while self._undo:
            self._undo.pop()()
        self._ttys = []  # a wrapper someone kept (a logging handler) no longer redirects anything

    def _note(self, signum, frame) -> None:  # a signal handler: note it; never raise, never print
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
        else:
            self.later.append(name)  # the checkpoint under way completes
        self._leave_dead_terminal()  # a closed terminal sends SIGHUP, or its launcher dies of it

    def _leave_dead_terminal(self) -> None:
        """Point stdout and stderr at /dev/null where they were a terminal that is now hung up. A second signal's
        handler can run inside the first's (between any two bytecodes), so this never assumes a list it read
        earlier is still current: the fd leaves the list before it is redirected, and redirecting twice is harmless."""
        for fd in tuple(self._ttys):
            if fd in self._ttys and not os.isatty(fd):
                self._ttys = [other for other in self._ttys if other != fd]
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)

    def requested(self, step: int) -> bool:
        """True on every process once any process has been asked to stop (see the module docstring)."""
        acc = self.accelerator
        if self.received is not None:
            self._leave_dead_terminal()  # in case the terminal hung up after the signal
        if acc.num_processes == 1:
            return self.received is not None
        if step % CHECK_EVERY:
            return False
        import torch

        names = [sig.name for sig in SIGNALS]
        flags = torch.zeros(len(names), device=acc.device)
        if self.received is not None:
            flags[names.index(self.received)] = 1
        arrived = acc.reduce(flags, "sum").tolist()
        if self.received is None and any(arrived):  # the signal another process received, for preempted.json
            self.received, self.elsewhere = names[next(i for i, n in enumerate(arrived) if n)], True
        return any(arrived)

    def leave(self, step: int, checkpoint: Path) -> None:
        """After the checkpoint of `step` is saved: write the marker, say so, exit with EXIT_CODE."""
        acc = self.accelerator
        if acc.is_main_process:
            record = {"signal": self.received, "process": "another" if self.elsewhere else "this", "step": step,
                      "checkpoint": str(checkpoint), "exit_code": EXIT_CODE, "later_signals": self.later,
                      "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            write_atomic(self.out / MARKER, json.dumps(record, indent=1) + "\n")
            print(f"preempted ({record['signal']}): saved {checkpoint} at step {step}; exiting with code "
                  f"{EXIT_CODE}. Continue with --resume_from_checkpoint latest --output_dir {self.out} "
                  f"(slurm/train.sbatch requeues the job and does this)", flush=True)
        acc.end_training()
        sys.exit(EXIT_CODE)


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # a test's capture, a closed stream
        return None


class _Outlives:
    """sys.stdout or sys.stderr while it is a terminal: a write or flush that the hung-up terminal refuses (EIO)
    points the output at /dev/null (`leave`) instead of raising; the line is lost, the run goes on."""

    def __init__(self, stream, leave):
        self._stream, self._leave = stream, leave

    def _or_leave(self, call, *args):
        try:
            return call(*args)
        except OSError as err:
            if err.errno != errno.EIO:
                raise
            self._leave()
            return None

    def write(self, text):
        written = self._or_leave(self._stream.write, text)
        return len(text) if written is None else written

    def flush(self) -> None:
        self._or_leave(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)
