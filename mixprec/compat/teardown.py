"""The end of a process of a multi-process run (torch 2.13.0 with gloo, deepspeed 0.19.8; seen under ZeRO-3).

Now and then a process of a 2-process ZeRO-3 run on CPUs aborted after the run had completed and every
file was written: "terminate called without an active exception", SIGABRT, rank 1, while the interpreter was
tearing itself down (2 of about 40 ZeRO-3 launches in two full test runs; none in 38 launches in a row on an
idle machine). The launcher then reports the whole job as failed, a scheduler marks it failed, and a requeue
logic that waits for exit code 75 never sees it. The same abort is known upstream in torch when gloo's C++
worker threads still hold tensors while the interpreter is being torn down
(pull request pytorch/pytorch/pull/179291, closed unmerged in 2026-04).

`end_process` runs the process's `main`, then the interpreter's own exit functions (atexit: W&B, logging,
multiprocessing's workers) and flushes the streams while the interpreter is whole, and ends the process with
`os._exit` and main's exit code: the teardown where the abort happens is skipped. No canary can show an abort
this rare on demand: tests/test_compat.py shows what the workaround keeps (exit codes, output, exit functions)
instead; drop it for several processes when a torch/DeepSpeed upgrade goes through a full test run without
the abort.

One-process runs end the same way, for time: the interpreter's teardown of what a run has imported (torch,
torch._dynamo, DeepSpeed through Accelerate's save_model) took 0.8 s of the end of a 20-step run of the default
command on the 2-core Intel Xeon with AMX (1.65-1.71 s from the run's end to the process's exit, against
0.85-0.91 s without it; three runs each, `python recipes/train.py --max_steps 20`), time in which nothing of
the run is left to do: everything it writes is closed before `main` returns, and the exit functions run. Not
where a tracer or profiler is active (coverage, `python -m cProfile`): those write their results in the
teardown, so the process then ends as usual.
"""
from __future__ import annotations

import atexit
import os
import sys
import traceback
from typing import Callable


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def exit_code(exited: SystemExit) -> int:
    """The exit code Python itself would give for `exited` (printing a message if it carries one)."""
    if exited.code is None:
        return 0
    if isinstance(exited.code, int):
        return exited.code
    print(exited.code, file=sys.stderr)
    return 1


def end_process(main: Callable[[], object]) -> None:
    """Run `main`, then end the process with main's exit code without the interpreter's teardown (see the module
    docstring); as usual where a tracer or profiler is active in a one-process run."""
    if _world_size() <= 1 and (sys.gettrace() is not None or sys.getprofile() is not None):
        main()
        return
    try:
        main()
        code = 0
    except SystemExit as exited:
        code = exit_code(exited)
    except BaseException:  # as Python would: the traceback, exit code 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
