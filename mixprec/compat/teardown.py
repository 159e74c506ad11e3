"""The end of a process of a multi-process run (torch 2.13.0 with gloo, deepspeed 0.19.8; seen under ZeRO-3).

Now and then a process of a 2-process ZeRO-3 run on CPUs aborted after the run had completed and every
file was written: "terminate called without an active exception", SIGABRT, rank 1, while the interpreter was
tearing itself down (2 of about 40 ZeRO-3 launches in two full test runs; none in 38 launches in a row on an
idle machine). The launcher then reports the whole job as failed, a scheduler marks it failed, and a requeue
logic that waits for exit code 75 never sees it. The same abort is known upstream in torch when gloo's C++
worker threads still hold tensors while the interpreter is being torn down
(pull request pytorch/pytorch/pull/179291, closed unmerged in 2026-04).

The workaround: such a process skips the interpreter's teardown (`must_skip`): mixprec.process_end.end_process
ends it with `exit_now`, which runs the exit functions (atexit's private `_run_exitfuncs`: the only way to run them
before `os._exit`), flushes the streams and calls `os._exit` with main's exit code (or, for an uncaught Ctrl-C,
kills the process with SIGINT, as Python does). No canary can show an abort
this rare on demand: tests/test_compat.py shows what the workaround keeps (exit codes, output, exit functions)
instead; drop it when a torch/DeepSpeed upgrade goes through a full test run without the abort. (One-process
runs end the same way for time, not for this defect: mixprec.process_end.)

A hang of the same family (torch 2.13.0, gloo, DDP; the standalone recipes, about 1 in 50 launches of 2
processes beside other busy processes, 2026-12-07): `accelerator.end_training()` destroys the process group
while the DDP wrapper is still alive, so its Reducer holds the group's last reference. When the wrapper is then
freed (main returns), the Reducer's destructor, which pybind11 runs holding the GIL, destroys gloo's group and
joins gloo's worker thread; that thread was still releasing the last collective's work, whose tensor must take
the GIL to drop its Python object: each waits for the other, forever (native stacks: `py-spy dump --native`;
the group's own Python binding releases the GIL in its destructor, the Reducer's does not). The full recipe's
wrapper is still alive at the destroy but is never freed: its processes end with `exit_now`, and nothing between
(no full garbage collection in the exit functions) releases it; the standalone recipes free it before
`end_training()`. tests/hooks/sitecustomize.py logs the order in each process and tests/test_standalone_*.py
assert it (`helpers.teardown_order`): deterministic, where the hang itself is a race.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys


def must_skip() -> bool:
    """A process of several (WORLD_SIZE > 1) must skip the interpreter's teardown, tracer or not."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def exit_now(code: int, by_signal: int | None = None) -> None:
    """End the process with `code` after its exit functions, without the interpreter's teardown; with `by_signal`,
    killed by that signal's default action instead, as Python ends on an uncaught KeyboardInterrupt (SIGINT: the
    shell's 130, a parent's -2)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if by_signal is not None:
        signal.signal(by_signal, signal.SIG_DFL)
        os.kill(os.getpid(), by_signal)
    os._exit(code)
