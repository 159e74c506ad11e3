"""How a recipe's process ends: `end_process(main)` runs `main`, then the interpreter's own exit functions (atexit:
W&B, logging, multiprocessing's workers), flushes the streams while the interpreter is whole, and ends the process
with `os._exit` and main's exit code, skipping the interpreter's teardown (the private calls that takes are in
mixprec.compat.teardown, `exit_now`).

- A process of several: a defect's workaround (mixprec.compat.teardown: a ZeRO-3 process on CPUs now and then
  aborts in the teardown after a completed run, and the job is reported failed).
- One process: for time. The teardown of what a run has imported (torch, torch._dynamo, DeepSpeed through
  Accelerate's save_model) took 0.8 s of the end of a 20-step run of the default command on the 2-core Intel Xeon
  with AMX (1.65-1.71 s from the run's end to the process's exit, against 0.85-0.91 s without it; three runs
  each, `python recipes/train.py --max_steps 20`), time in which nothing of the run is left to do: everything it
  writes is closed before `main` returns, and the exit functions run. Not where a tracer or profiler is active
  (coverage, `python -m cProfile`): those write their results in the teardown, so the process then ends as usual.

An uncaught KeyboardInterrupt (Ctrl-C before the recipe's own signal handling is installed) ends the process as
Python itself would: the traceback, then killed by SIGINT (a shell's 130), not exit code 1.
"""
from __future__ import annotations

import signal
import sys
import traceback
from typing import Callable

from .compat import teardown


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
    docstring); as usual in a one-process run under a tracer or profiler."""
    if not teardown.must_skip() and (sys.gettrace() is not None or sys.getprofile() is not None):
        main()
        return
    try:
        main()
        code = 0
    except SystemExit as exited:
        code = exit_code(exited)
    except KeyboardInterrupt:  # as Python would: the traceback, then killed by SIGINT (130 in a shell)
        traceback.print_exc()
        teardown.exit_now(128 + signal.SIGINT, by_signal=signal.SIGINT)
    except BaseException:  # as Python would: the traceback, exit code 1
        traceback.print_exc()
        code = 1
    teardown.exit_now(code)
