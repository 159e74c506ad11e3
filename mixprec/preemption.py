"""Preemption: on SIGUSR1 or SIGTERM, save a checkpoint and leave so that the job can be requeued.

SLURM sends SIGUSR1 ahead of the time limit (`#SBATCH --signal=USR1@120` in slurm/train.sbatch) and
SIGTERM when it preempts, requeues or cancels a job, then SIGKILL once the grace time is over (KillWait,
30 s by default). The handlers only note the signal. After each optimizer step the loop asks `requested()`:
the flag is reduced over all processes, so every rank stops after the same step even if the signal reached
them a moment apart. The loop then saves a checkpoint as usual and calls `leave()`, which writes
`<output_dir>/preempted.json` (signal, step, checkpoint) and exits with code 75 (EX_TEMPFAIL, "try again").
slurm/train.sbatch requeues the job when it finds that file (`accelerate launch` turns every non-zero
exit code into 1, so the file is what the template reads); the requeued job resumes from the checkpoint
with `--resume_from_checkpoint latest` in the same output folder.

Cost: one all-reduce of one number per optimizer step when there are several processes (none with one).
"""
from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from . import faults
from .checkpointing import write_atomic

EXIT_CODE = 75  # EX_TEMPFAIL from sysexits.h: stopped on purpose, run again to continue
MARKER = "preempted.json"
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Preemption:
    """Installs the handlers (main thread only) and clears a marker left by an earlier, preempted attempt."""

    def __init__(self, accelerator, out: Path):
        self.accelerator, self.out = accelerator, out
        self.received: str | None = None
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                signal.signal(sig, self._note)
        if accelerator.is_main_process:
            (out / MARKER).unlink(missing_ok=True)

    def _note(self, signum, frame) -> None:  # a signal handler: set a flag, nothing else
        if self.received is None:
            self.received = signal.Signals(signum).name

    def requested(self, step: int) -> bool:
        """True on every process when any process has received SIGUSR1 or SIGTERM. Call after each step."""
        if faults.active("pause_at_step", step):  # tests: wait here, in lockstep, until some process is signalled
            self.accelerator.print(f"[fault injection] pause_at_step={step}: waiting for a signal", flush=True)
            for _ in range(12_000):  # at most ~10 minutes; counted in iterations so that all ranks agree
                if self._any():
                    return True
                time.sleep(0.05)
        return self._any()

    def _any(self) -> bool:
        if self.accelerator.num_processes == 1:
            return self.received is not None
        flag = torch.tensor([float(self.received is not None)], device=self.accelerator.device)
        return self.accelerator.reduce(flag, "sum").item() > 0

    def leave(self, step: int, checkpoint: Path) -> None:
        """After the checkpoint of `step` is saved: write the marker, say so, exit with EXIT_CODE."""
        acc = self.accelerator
        if acc.is_main_process:
            record = {"signal": self.received or "another process's signal", "step": step,
                      "checkpoint": str(checkpoint), "exit_code": EXIT_CODE,
                      "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            write_atomic(self.out / MARKER, json.dumps(record, indent=1) + "\n")
            print(f"preempted ({record['signal']}): saved {checkpoint} at step {step}; exiting with code "
                  f"{EXIT_CODE}. Continue with --resume_from_checkpoint latest --output_dir {self.out} "
                  f"(slurm/train.sbatch requeues the job and does this)", flush=True)
        acc.end_training()
        sys.exit(EXIT_CODE)
