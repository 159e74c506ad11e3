"""Signals sent to `accelerate launch` (accelerate 1.15.0 and 1.16.0, torch 2.13.0; canaries: tests/test_compat.py).

- One process, accelerate 1.15 (`subprocess.Popen` then `wait`): a SIGTERM, SIGUSR1, SIGHUP or SIGINT to the
  launcher ends the launcher at once (SIGINT with a KeyboardInterrupt traceback), and the training process goes
  on as an orphan.
- One process, accelerate 1.16 (`psutil.Popen`, the child's stderr read through a pipe): a SIGTERM or SIGINT to
  the launcher is passed on to the training process and its descendants as SIGTERM, and whichever of them is
  still running 5 s later gets SIGKILL: a checkpoint that takes longer is cut short. SIGUSR1 and SIGHUP end
  the launcher at once, as in 1.15, and the child's stderr then leads nowhere (a write to it fails).
- Several processes (torch's elastic agent, inside the launcher): SIGTERM, SIGINT, SIGHUP and SIGQUIT are
  passed on to the workers as they came, with 30 s before SIGKILL; accelerate 1.15 then lets the agent's
  SignalException end the launcher with a traceback, 1.16 exits with 128 + the signal's number and no
  traceback. Any other signal (SIGUSR1: SLURM's usual warning) kills the launcher and orphans the workers,
  which run in sessions of their own, so that a signal to the launcher's process group misses them too.

`stop_with_launcher` asks the Linux kernel (prctl PR_SET_PDEATHSIG) to send this process SIGTERM when its
parent, the launcher, dies: the trainer then checkpoints and exits as on any stop signal, and nothing is left
running. `outlive_launcher` keeps a one-process launcher that SIGKILLs after a grace period (1.16) from cutting
the checkpoint short: on the first stop signal this process receives, it points its stderr at its stdout and
ends the launcher with SIGKILL, which leaves the trainer as 1.15 leaves it, an orphan that saves and exits.
A watcher thread does this as the signal arrives (Python's wakeup fd), so that a main thread busy in a long
operation does not delay it past the grace period. Elsewhere than Linux both do nothing.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import threading
from importlib import metadata

PR_SET_PDEATHSIG = 1
LAUNCHER_VARS = ("LOCAL_RANK", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND")
KILLS_AFTER_GRACE = (1, 16)  # the first accelerate whose one-process launcher SIGKILLs its child 5 s after SIGTERM
ACCELERATE_LAUNCH = re.compile(rb"(^|/)(accelerate\0launch|accelerate-launch)(\0|$)|\0accelerate\.commands\.launch\0")


def launched() -> bool:
    """Whether a launcher (accelerate launch, torchrun) started this process."""
    return any(name in os.environ for name in LAUNCHER_VARS)


def _prctl(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def stop_with_launcher(sig: int = signal.SIGTERM):
    """When launched by a launcher on Linux, get `sig` when it dies. Returns a function that undoes it."""
    if not sys.platform.startswith("linux") or not launched() or not _prctl(sig):
        return lambda: None
    if os.getppid() == 1:  # the launcher died before the request was made
        os.kill(os.getpid(), sig)
    return lambda: _prctl(0)


def accelerate_version() -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in re.findall(r"\d+", metadata.version("accelerate"))[:2])
    except metadata.PackageNotFoundError:
        return (0,)


def grace_killing_parent() -> int | None:
    """The pid of this process's parent when it is the one-process `accelerate launch` of a version that SIGKILLs
    its child a few seconds after passing a signal on (see the module docstring); otherwise None."""
    if not sys.platform.startswith("linux") or "LOCAL_RANK" in os.environ or not launched():
        return None  # torchrun's workers have LOCAL_RANK: the elastic agent waits 30 s
    if accelerate_version() < KILLS_AFTER_GRACE:
        return None
    parent = os.getppid()
    try:
        cmdline = open(f"/proc/{parent}/cmdline", "rb").read()
    except OSError:
        return None
    return parent if ACCELERATE_LAUNCH.search(cmdline) else None


def _leave(launcher: int) -> None:
    """Take stderr off the launcher's pipe and end the launcher before it can SIGKILL this process."""
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os.dup2(1, 2)
    if os.getppid() != launcher:  # it died already (SIGHUP, SIGUSR1): the pid may be someone else's by now
        return
    os.kill(launcher, signal.SIGKILL)
    try:
        print(f"stopping: accelerate launch (pid {launcher}) would SIGKILL this process 5 s after passing the signal "
              f"on, before a longer checkpoint is saved; ended the launcher instead, so that the checkpoint "
              f"completes", flush=True)
    except OSError:
        pass


def outlive_launcher(stop_signals) -> callable:
    """Under a launcher that SIGKILLs after a grace period: on the first of `stop_signals` end that launcher (see
    the module docstring). Call from the main thread, after installing Python handlers for `stop_signals`.
    Returns a function that undoes it."""
    launcher = grace_killing_parent()
    if launcher is None or threading.current_thread() is not threading.main_thread():
        return lambda: None
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    wanted = {int(s) for s in stop_signals}

    def watch() -> None:
        with os.fdopen(read, "rb", buffering=0) as pipe:
            while byte := pipe.read(1):
                if byte[0] in wanted:
                    _leave(launcher)
                    break
            while pipe.read(1):  # drain until undone
                pass

    threading.Thread(target=watch, name="mixprec-outlive-launcher", daemon=True).start()

    def undo() -> None:
        signal.set_wakeup_fd(previous)
        os.close(write)
    return undo
