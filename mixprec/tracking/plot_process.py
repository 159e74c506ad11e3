"""metrics.png drawn by a helper process, so that the end of a run does not wait for matplotlib's import.

Importing matplotlib and drawing the six panels took about 0.7 s of a short run's end (benchmarks/startup.py,
docs/performance.md "Start-up beyond Accelerate's own"). A `PlotProcess` is a helper process started with the
run (main process only, once the run's settings are checked: mixprec.training.startup):
`python -m mixprec.tracking.plot_process` imports matplotlib while the run loads its data and trains, then waits.
At the end, after summary.json, the run calls `request(out)` and `result()` waits for the picture: metrics.png
is written after summary.json and before the command exits, as before, by the same `plots.plot_run`; the run's
process no longer imports matplotlib.

A process that has matplotlib imported already (a notebook, a test run in its own process, a tool that drew
before) starts no helper (`PlotProcess.worth_starting`): its own drawing is quicker than a new interpreter's import.

The helper takes no signals (a Ctrl-C or a scheduler's SIGTERM is the run's to handle) and ends when its input
closes: at the run's end, or when the run's process ends however it ends. Where it cannot start, or fails, the run
draws in its own process as it did before (`result()` returns None): the picture never depends on the helper.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


class PlotProcess:
    @staticmethod
    def worth_starting() -> bool:
        """A helper saves the run matplotlib's import; where matplotlib is imported already it would add one."""
        return "matplotlib" not in sys.modules

    def __init__(self):
        self.proc, self.asked = None, False
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "mixprec.tracking.plot_process"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True)
        except OSError:
            self.proc = None

    def request(self, out: Path) -> None:
        """Draw `out`/metrics.png now (the run's metrics.jsonl is complete)."""
        if self.proc is None or self.asked or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.write(f"{out}\n")
            self.proc.stdin.close()
            self.asked = True
        except OSError:  # the helper is gone: the run draws itself
            self.close()

    def result(self) -> dict | None:
        """The helper's answer: {"path": ...} or {"error": ..., "type": ..., "errno": ..., "filename": ...}; None
        when it was not asked or gave no answer (the run then draws itself)."""
        if self.proc is None or not self.asked:
            return None
        try:
            line = self.proc.stdout.readline()
            answer = json.loads(line) if line.strip() else None
        except (OSError, ValueError):
            answer = None
        self.close()
        return answer if isinstance(answer, dict) else None

    def close(self) -> None:
        """End the helper (its input closes: it exits), and wait for it; one never asked (a start refused, a run
        stopped) is stopped at once: it has nothing to finish."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if not self.asked and proc.poll() is None:
            proc.kill()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def error_of(answer: dict) -> Exception:
    """The helper's failure as the exception the run's own drawing would have raised (an OSError keeps its errno
    and file, for the refused-write line and exit code 74)."""
    if answer.get("errno") is not None:
        return OSError(answer["errno"], answer.get("strerror") or answer["error"], answer.get("filename"))
    return RuntimeError(answer["error"])  # the warning names answer["type"]


def serve() -> None:
    """The helper: import matplotlib (and draw once, off screen, so that its fonts are loaded) while the run
    trains, then draw the run folder named on the first input line and answer one JSON line. Signals are the
    run's: the helper ignores them and ends when its input closes."""
    import io
    import signal

    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    answers, sys.stdout = sys.stdout, sys.stderr  # the answer alone on the output: anything printed goes aside
    from matplotlib.figure import Figure
    from PIL import Image  # noqa: F401  (plots.save_png's)

    from . import plots

    warm = Figure(figsize=(1, 1), dpi=20)
    warm.subplots().set_title("warm-up")
    warm.savefig(io.BytesIO(), format="png")
    line = sys.stdin.readline().strip()
    if not line:
        return
    try:
        answer = {"path": str(plots.plot_run(Path(line)))}
    except Exception as err:  # noqa: BLE001  the run decides what a failure means
        answer = {"error": str(err), "type": type(err).__name__, "errno": getattr(err, "errno", None),
                  "strerror": getattr(err, "strerror", None), "filename": getattr(err, "filename", None)}
    print(json.dumps(answer, default=str), file=answers, flush=True)


if __name__ == "__main__":
    serve()
