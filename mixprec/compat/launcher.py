"""Signals sent to `accelerate launch` (accelerate 1.15.0, torch 2.13.0; canary: tests/test_compat.py).

- One process (Accelerate's simple launcher: `subprocess.Popen` then `wait`): a SIGTERM, SIGUSR1 or SIGINT
  to the launcher ends the launcher at once, and the training process goes on as an orphan.
- Several processes (torch's elastic agent, inside the launcher): SIGTERM and SIGINT are passed on to the
  workers, with 30 s before SIGKILL; any other signal (SIGUSR1: SLURM's usual warning) kills the launcher
  and orphans the workers, which run in sessions of their own, so that a signal to the launcher's process
  group misses them too.

`stop_with_launcher` asks the Linux kernel (prctl PR_SET_PDEATHSIG) to send this process SIGTERM when its
parent, the launcher, dies: the trainer then checkpoints and exits as on any stop signal, and nothing is left
running. Elsewhere than Linux it does nothing.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
LAUNCHER_VARS = ("LOCAL_RANK", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND")


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
