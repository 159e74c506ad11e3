"""Fault injection from outside the product: real crashes and real bad numbers at a chosen step.

The product knows nothing of this. A recipe started with tests/hooks on PYTHONPATH and MIXPREC_TEST_FAULTS set
gets these wrappers from tests/hooks/sitecustomize.py as its modules load; an in-process test calls `apply`.
MIXPREC_TEST_FAULTS is a comma-separated list of name=step (or name=step:module):

- kill_at_step=N: SIGKILL when optimizer step N is done, before its log or checkpoint;
- kill_during_save=N: SIGKILL after the checkpoint of step N is written and its manifest is complete, before it
  is renamed into place and named `latest`;
- pause_at_step=N: when step N is done, print "[test hook] paused at step N" and wait (at most 10 minutes) until
  the file N exists in the folder named by MIXPREC_TEST_RELEASE. Meanwhile, once this process has received a stop
  signal, the hook writes `signalled-<RANK>` there: a test signals the run while it is surely mid-training,
  waits for that file, then releases the run;
- nan_loss_at_step=N: the model's output is NaN in the training forward passes of step N;
- nan_loss_at_batch=B: the model's output is NaN in the B-th training forward pass (micro-batch), counted from 1
  in this process;
- inf_grad_at_step=N[:MODULE]: one gradient element of MODULE's first parameter (default: the model's first
  parameter) is +inf in step N's backward passes;
- tracker_error=N: every experiment tracker raises when asked to log step N;
- slow_save=S: every checkpoint takes S seconds longer to save (a big model's checkpoint, on a tiny one);
- disk_full_at=NAME: just before the product writes the file NAME (summary.json, metrics.png, config.yaml: any
  file written through `write_atomic`, and metrics.png), the file system that holds it is filled to the brim by
  a file `filler` at its mount point (a test's own tmpfs), which the test removes;
- disk_read_only_at=NAME: the same moment, the folder that holds NAME turns read-only: a read-only bind mount
  over it (root only; the files the run holds open are on the mount below), which the test unmounts.
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from pathlib import Path

ENV, RELEASE_ENV = "MIXPREC_TEST_FAULTS", "MIXPREC_TEST_RELEASE"


def parse(spec: str) -> list[tuple[str, int, str | None]]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, value = item.partition("=")
        step, _, module = value.partition(":")
        out.append((name, int(step) if step.isdigit() else step, module or None))  # disk_*_at: a file name
    return out


class Faults:
    def __init__(self, spec: str):
        self.items = parse(spec)
        self.done = 0  # optimizer steps completed in this process

    def at(self, name: str, step: int):
        """The fault entry `name` for `step`, or None."""
        return next((item for item in self.items if item[0] == name and item[1] == step), None)

    def names(self) -> set[str]:
        return {name for name, _, _ in self.items}

    # the wrappers -------------------------------------------------------------------------------------------

    def step_end(self, original):
        faults = self

        def step_end(run):
            step = run.step + 1
            if faults.at("kill_at_step", step):
                _kill(f"kill_at_step={step}")
            if faults.at("pause_at_step", step):
                _pause(run, step)
            result = original(run)
            faults.done = run.step
            return result
        return step_end

    def publish(self, original):
        faults = self

        def _publish(tmp, final, root, name):
            if faults.at("kill_during_save", int(name.split("_")[-1])):
                _kill(f"kill_during_save={name}")
            return original(tmp, final, root, name)
        return _publish

    def save(self, original):
        faults = self

        def save(*args, **kwargs):
            slow = next((step for name, step, _ in faults.items if name == "slow_save"), 0)
            if slow:
                print(f"[test hook] slow_save: {slow} s", flush=True)
                time.sleep(slow)
            return original(*args, **kwargs)
        return save

    def build(self, original):
        faults = self

        def build(name, info, model_args=None):
            model = original(name, info, model_args)
            faults.attach(model)
            return model
        return build

    def tracker_log(self, original):
        faults = self

        def _log(tracker, values, step, **kwargs):
            if faults.at("tracker_error", step):
                raise OSError(f"[test hook] tracker_error={step}")
            return original(tracker, values, step, **kwargs)
        return _log

    def write_atomic(self, original):
        faults = self

        def write_atomic(path, text):
            faults.disk_trouble(Path(path))
            return original(path, text)
        return write_atomic

    def plot_run(self, original):
        faults = self

        def plot_run(run_dir, path=None):
            faults.disk_trouble(Path(path) if path else Path(run_dir) / "metrics.png")
            return original(run_dir, path)
        return plot_run

    def disk_trouble(self, path: Path) -> None:
        """disk_full_at / disk_read_only_at: the file system of `path` full, or its folder read-only, from now on."""
        if self.at("disk_full_at", path.name):
            mount = path.resolve().parent
            while not os.path.ismount(mount):
                mount = mount.parent
            print(f"[test hook] disk_full_at={path.name}: filling {mount}", flush=True)
            _fill(mount / "filler")
        if self.at("disk_read_only_at", path.name):
            folder = str(path.resolve().parent)
            print(f"[test hook] disk_read_only_at={path.name}: {folder} read-only", flush=True)
            subprocess.run(["mount", "--bind", folder, folder], check=True)
            subprocess.run(["mount", "-o", "remount,bind,ro", folder], check=True)

    def attach(self, model) -> None:
        import torch

        if self.names() & {"nan_loss_at_step", "nan_loss_at_batch"}:
            seen = [0]

            def nan_output(module, inputs, output):
                if module is not model or not (module.training and torch.is_grad_enabled()):  # not a copy's pass
                    return output
                seen[0] += 1
                if self.at("nan_loss_at_step", self.done + 1) or self.at("nan_loss_at_batch", seen[0]):
                    return output * float("nan")
                return output
            model.register_forward_hook(nan_output)
        for name, step, where in self.items:
            if name != "inf_grad_at_step":
                continue
            module = model.get_submodule(where) if where else model
            param = next(p for p in module.parameters() if p.requires_grad)

            def inf_grad(grad, step=step):
                if self.done + 1 != step:
                    return grad
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
                return grad
            param.register_hook(inf_grad)


def _fill(filler: Path) -> None:
    """Write zeros to `filler` until its file system refuses even one byte more."""
    with open(filler, "ab", buffering=0) as f:
        for size in (1 << 20, 1 << 16, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise


def _kill(what: str) -> None:
    print(f"[test hook] {what}: SIGKILL", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _pause(run, step: int) -> None:
    folder = Path(os.environ[RELEASE_ENV])
    signalled = folder / f"signalled-{os.environ.get('RANK', '0')}"
    print(f"[test hook] paused at step {step}", flush=True)
    deadline = time.monotonic() + 600
    while not (folder / str(step)).exists() and time.monotonic() < deadline:
        if run.preemption.received and not signalled.exists():
            signalled.touch()
        time.sleep(0.05)


TARGETS = {  # module -> [(attribute path, wrapper name)]
    "mixprec.training.run": [("Run.step_end", "step_end")],
    "mixprec.run_folder.checkpointing": [("_publish", "publish"), ("save", "save"), ("write_atomic", "write_atomic")],
    "mixprec.tracking.plots": [("plot_run", "plot_run")],
    "mixprec.models": [("build", "build")],
    "mixprec.tracking.trackers": [("Guarded._log", "tracker_log")],
}


def patch_module(faults: Faults, module, setattr_fn=setattr) -> None:
    """Wrap the targets of `module` (see TARGETS) with the matching fault wrappers."""
    for path, wrapper in TARGETS[module.__name__]:
        owner_name, _, attr = path.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        setattr_fn(owner, attr, getattr(faults, wrapper)(getattr(owner, attr)))


def apply(spec: str, monkeypatch) -> Faults:
    """In-process: wrap every target now, undone by `monkeypatch` after the test."""
    import importlib

    faults = Faults(spec)
    for name in TARGETS:
        patch_module(faults, importlib.import_module(name), monkeypatch.setattr)
    return faults
