"""Stopping on a signal, however the run was started: SIGTERM, SIGHUP, SIGUSR1 or SIGINT to `accelerate launch`, to
its process group, or to a training process itself, with one process or two (gloo), or to `python` directly.
Every case ends the same way: each training process checkpoints once at the same step, preempted.json names that
step and the signal that reached the trainers, and no process is left running. A resumed run then ends exactly
where an uninterrupted one ends. Written for both launchers the dependency range allows (accelerate 1.15 and
1.16; mixprec/compat/launcher.py describes each)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import CONFIGS, CPU_CONFIG, REPO, TRAIN, base_env, free_port, hooks_env, live_processes, run_recipe
from mixprec.compat.launcher import KILLS_AFTER_GRACE, accelerate_version
from mixprec.run_folder.preemption import EXIT_CODE, MARKER

pytestmark = pytest.mark.slow
ARGS = ["--max_steps", "60", "--log_every", "10", "--mixed_precision", "no"]
PAUSE = 20  # a multiple of preemption.CHECK_EVERY: with two processes the flag is agreed on at this step


def pids(needle: str, rank: int | None = None) -> list[int]:
    """Live training processes (not their launcher) whose command line contains `needle` (and whose environment
    has RANK=rank)."""
    return [pid for pid, cmdline, environ in live_processes()
            if needle in cmdline and "train.py" in cmdline and "/accelerate\0launch" not in cmdline
            and (rank is None or f"RANK={rank}".encode() in environ)]


class Launched:
    """A recipe started in its own process group, paused at step PAUSE by tests/faults.py until released."""

    def __init__(self, tmp_path: Path, processes: int, launcher: str = "accelerate", faults: str = "",
                 args: list | None = None, env: dict | None = None):
        self.out, self.log, self.release = tmp_path / "run", tmp_path / "run.log", tmp_path / "release"
        self.release.mkdir()
        if launcher == "python":
            cmd = [sys.executable, str(TRAIN)]
        else:
            config = CPU_CONFIG if processes == 1 else CONFIGS / "multi_cpu.yaml"
            cmd = ["accelerate", "launch", "--config_file", str(config), "--main_process_port", str(free_port()),
                   str(TRAIN)]
        env = {**(env or {}), **hooks_env(faults=",".join(filter(None, [f"pause_at_step={PAUSE}", faults])),
                                          release=self.release)}
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([*cmd, *map(str, args or ARGS), "--output_dir", str(self.out)], stdout=f,
                                         stderr=subprocess.STDOUT, cwd=REPO, env=base_env(env),
                                         start_new_session=True)
        self.processes = processes

    def text(self) -> str:
        return self.log.read_text()

    def wait_paused(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while self.text().count(f"[test hook] paused at step {PAUSE}") < self.processes:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no pause (exit {self.proc.poll()}):\n{self.text()[-4000:]}")
            time.sleep(0.1)

    def release_when_signalled(self, ranks: list[int], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not all((self.release / f"signalled-{r}").exists() for r in ranks):
            if time.monotonic() > deadline:
                pytest.fail(f"ranks {ranks} never saw the signal:\n{self.text()[-4000:]}")
            time.sleep(0.05)
        (self.release / str(PAUSE)).touch()

    def wait_all_gone(self, timeout: float = 120) -> int | None:
        """The launcher's exit code (None if it died by a signal), once no training process is left."""
        code = self.proc.wait(timeout)
        code = None if code < 0 else code
        deadline = time.monotonic() + timeout
        while pids(str(self.out)):
            if time.monotonic() > deadline:
                pytest.fail(f"training processes left running: {pids(str(self.out))}\n{self.text()[-3000:]}")
            time.sleep(0.1)
        return code

    def kill_leftovers(self) -> None:
        for pid in pids(str(self.out)):
            os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def send(run: Launched, target: str, sig: int) -> list[int]:
    """Send `sig` to the launcher, its process group, or training process rank 1 (rank 0 with one process);
    returns the ranks that receive it (directly, from the launcher, or from the kernel when the launcher dies)."""
    everyone = list(range(run.processes))
    if target == "launcher":
        os.kill(run.proc.pid, sig)
    elif target == "group":
        os.killpg(run.proc.pid, sig)
    else:
        rank = run.processes - 1
        (pid,) = pids(str(run.out), rank=rank if run.processes > 1 else None)
        os.kill(pid, sig)
        return [rank]
    return everyone


# SIGTERM, SIGHUP and SIGUSR1 to each target; SIGINT (the trainer handles it as it handles SIGTERM) to the
# launchers, which treat it each in their own way
SIGNALS = [(sig, target) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGINT)
           for target in ("launcher", "group", "trainer") if sig != signal.SIGINT or target == "launcher"]
ACCELERATE_1_16 = accelerate_version() >= KILLS_AFTER_GRACE


def arrived(marker: dict, processes: int, target: str, sig: int) -> bool:
    """Whether preempted.json names the signal that reached the trainers first: `sig` itself where it is sent
    to them or passed on as it came, SIGTERM where a launcher passes SIGTERM on or dies (the kernel's SIGTERM);
    where both reach the one trainer at once, either first and the other among `later_signals`."""
    if target == "group" and processes == 1 and sig != signal.SIGTERM:
        # the one trainer is in the launcher's group and gets `sig` itself; a launcher that dies of it adds the
        # kernel's SIGTERM, and which of the two a busy machine hands to Python first is a race: both are recorded
        return sig.name in [marker["signal"], *marker["later_signals"]] and marker["signal"] in (sig.name, "SIGTERM")
    if target in ("trainer", "group") and processes == 1:
        return marker["signal"] == sig.name
    return marker["signal"] in (sig.name, "SIGTERM")


def no_traceback(text: str, target: str) -> bool:
    """No traceback from a trainer; none from a signalled launcher either on accelerate 1.16 (1.15's lets torch's
    SignalException through with several processes, and a KeyboardInterrupt with one). A launcher whose trainer
    exits with 75 reports it with a traceback of its own (CalledProcessError, ChildFailedError)."""
    if re.search(r'File "[^"]*(/mixprec/|train\.py)"', text):
        return False
    return target == "trainer" or not ACCELERATE_1_16 or "Traceback" not in text


@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("sig,target", SIGNALS, ids=[f"{s.name[3:]}-{t}" for s, t in SIGNALS])
def test_a_signal_anywhere_checkpoints_once_and_leaves_nothing_running(tmp_path, processes, target, sig):
    run = Launched(tmp_path, processes)
    try:
        run.wait_paused()
        run.release_when_signalled(send(run, target, sig))
        code = run.wait_all_gone()
    finally:
        run.kill_leftovers()
    assert code != 0, run.text()[-3000:]  # the launcher never reports success (it reports 1, or dies by the signal)
    marker = json.loads((run.out / MARKER).read_text())
    assert marker["step"] == PAUSE and marker["exit_code"] == EXIT_CODE, marker
    ckpt = run.out / "checkpoints" / f"step_{PAUSE:07d}"
    assert (run.out / "checkpoints" / "latest").read_text() == ckpt.name
    assert {f"random_states_{r}.pkl" for r in range(processes)} <= {p.name for p in ckpt.iterdir()}  # each rank saved
    assert sorted(p.name for p in (run.out / "checkpoints").glob("step_*")) == [ckpt.name]  # once
    assert run.text().count("preempted (") == 1 and not (run.out / "summary.json").exists()
    assert arrived(marker, processes, target, sig), marker
    assert no_traceback(run.text(), target), run.text()[-3000:]
    assert not list((run.out / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_checkpoint_slower_than_the_launchers_patience_still_completes(tmp_path, sig):
    """A big model's checkpoint takes seconds. SLURM waits KillWait (30 s by default) after SIGTERM; accelerate
    1.16's one-process launcher passes SIGTERM (or Ctrl-C's SIGINT) on and SIGKILLs the trainer 5 s later, which
    would cut an 8 s checkpoint short: the trainer ends that launcher first (compat.outlive_launcher) and says so.
    Accelerate 1.15's launcher dies at once and the kernel hands the trainer SIGTERM."""
    run = Launched(tmp_path, 1, faults="slow_save=8")
    try:
        run.wait_paused()
        run.release_when_signalled(send(run, "launcher", sig))
        run.wait_all_gone()
    finally:
        run.kill_leftovers()
    assert json.loads((run.out / MARKER).read_text())["step"] == PAUSE, run.text()[-3000:]
    assert (run.out / "checkpoints" / "latest").read_text() == f"step_{PAUSE:07d}"
    said = "would SIGKILL this process 5 s after passing the signal on" in run.text()
    assert said == ACCELERATE_1_16, run.text()[-3000:]
    assert no_traceback(run.text(), "launcher"), run.text()[-3000:]


def test_later_signals_neither_interrupt_nor_corrupt_the_checkpoint(tmp_path):
    """Two SIGINTs 10 ms apart (a double Ctrl-C), then two more while the checkpoint is being saved: one
    complete checkpoint that a resumed run loads, no traceback, exit 75, and preempted.json lists what came after
    the first."""
    run = Launched(tmp_path, 1, launcher="python", faults="slow_save=3")
    try:
        run.wait_paused()
        (pid,) = pids(str(run.out))
        os.kill(pid, signal.SIGINT)
        time.sleep(0.01)
        os.kill(pid, signal.SIGINT)
        run.release_when_signalled([0])
        deadline = time.monotonic() + 120
        while "[test hook] slow_save" not in run.text() and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(2):
            os.kill(pid, signal.SIGINT)
            time.sleep(0.01)
        code = run.wait_all_gone()
    finally:
        run.kill_leftovers()
    assert code == EXIT_CODE, run.text()[-3000:]
    assert "Traceback" not in run.text() and "KeyboardInterrupt" not in run.text(), run.text()[-3000:]
    marker = json.loads((run.out / MARKER).read_text())
    # signals of one kind that arrive before the handler runs are one to the kernel: at least one later SIGINT
    assert marker["signal"] == "SIGINT" and set(marker["later_signals"]) == {"SIGINT"}, marker
    ckpt = run.out / "checkpoints" / f"step_{PAUSE:07d}"
    assert sorted(p.name for p in (run.out / "checkpoints").iterdir()) == ["latest", ckpt.name]
    resumed = run_recipe(*ARGS, "--max_steps", str(PAUSE + 2), "--resume_from_checkpoint", "latest", out=run.out,
                         launcher="python")
    assert f"at step {PAUSE} (epoch 0, batch {PAUSE})" in resumed.stdout  # the checkpoint loads


@pytest.mark.parametrize("hangup_signal", [True, False], ids=["SIGHUP", "no-signal"])
def test_a_closed_terminal_checkpoints_and_exits_75(tmp_path, hangup_signal):
    """A closed terminal or ssh session: the trainer's output is a terminal that is now hung up (every write
    fails) and SIGHUP arrives. The run still checkpoints, records SIGHUP and exits with 75. Without the signal (a
    process outside the terminal's session) the run goes on to its end. The terminal closes just after the
    pause's line is read: under load that is often between two writes of one print."""
    import pty
    import select

    out, release = tmp_path / "run", tmp_path / "release"
    release.mkdir()
    master, slave = pty.openpty()
    env = hooks_env(faults=f"pause_at_step={PAUSE}", release=release)
    proc = subprocess.Popen([sys.executable, str(TRAIN), *ARGS, "--output_dir", str(out)], stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, cwd=REPO, env=base_env(env), start_new_session=True)
    os.close(slave)
    seen, closed = bytearray(), False
    try:
        deadline = time.monotonic() + 300
        while f"paused at step {PAUSE}".encode() not in seen:  # read here: a read in progress keeps it open
            assert proc.poll() is None and time.monotonic() < deadline, seen.decode(errors="replace")[-3000:]
            if select.select([master], [], [], 0.1)[0]:
                seen.extend(os.read(master, 4096))
        os.close(master)  # the terminal's window closes: the kernel hangs it up (and sends SIGHUP)
        closed = True
        if hangup_signal:
            proc.send_signal(signal.SIGHUP)
            while not (release / "signalled-0").exists():
                assert proc.poll() is None and time.monotonic() < deadline, f"the trainer died: {proc.poll()}"
                time.sleep(0.05)
        (release / str(PAUSE)).touch()
        code = proc.wait(120)
    finally:
        if not closed:
            os.close(master)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if not hangup_signal:
        summary = json.loads((out / "summary.json").read_text())
        assert code == 0 and summary["status"] == "completed" and summary["steps"] == 60, (code, summary)
        assert not (out / MARKER).exists()
        return
    assert code == EXIT_CODE
    marker = json.loads((out / MARKER).read_text())
    assert marker["signal"] == "SIGHUP" and marker["step"] == PAUSE, marker
    assert (out / "checkpoints" / "latest").read_text() == f"step_{PAUSE:07d}"


def test_a_second_signal_whose_handler_runs_inside_the_first_leaves_the_dead_terminal_once(monkeypatch):
    """A closed terminal sends SIGHUP (and SIGCONT), its launcher passes one on: a second handler can run inside
    the first, between any two of its bytecodes. Here it runs where the first opens /dev/null: no exception may
    come out of the handler (it would end the run with a traceback) and both outputs end on /dev/null."""
    import pty

    from mixprec.run_folder.preemption import Preemption

    master, slave = pty.openpty()
    outputs = [os.dup(slave), os.dup(slave)]
    os.close(slave)
    os.close(master)  # hung up: the outputs are no longer terminals
    stop = Preemption(accelerator=None, out=Path("."))
    stop._ttys = list(outputs)
    real_open, inside = os.open, []

    def open_with_a_signal_between(*args, **kwargs):
        if not inside:
            inside.append(True)
            stop._note(signal.SIGCONT, None)  # the second handler, run inside the first
        return real_open(*args, **kwargs)

    monkeypatch.setattr(os, "open", open_with_a_signal_between)
    try:
        stop._note(signal.SIGHUP, None)
        null = os.stat(os.devnull).st_rdev
        assert inside and stop._ttys == [] and all(os.fstat(fd).st_rdev == null for fd in outputs)
        assert stop.received == "SIGHUP" and stop.later == ["SIGCONT"]
    finally:
        for fd in outputs:
            os.close(fd)


def test_python_launch_exits_75_and_the_resumed_run_matches(tmp_path):
    run = Launched(tmp_path, 1, launcher="python")
    try:
        run.wait_paused()
        run.release_when_signalled(send(run, "trainer", signal.SIGTERM))
        code = run.wait_all_gone()
    finally:
        run.kill_leftovers()
    assert code == EXIT_CODE == 75, run.text()[-3000:]
    assert json.loads((run.out / MARKER).read_text())["signal"] == "SIGTERM"
    resumed = run_recipe(*ARGS, "--resume_from_checkpoint", "latest", out=run.out, launcher="python")
    assert f"at step {PAUSE} (epoch 0, batch {PAUSE})" in resumed.stdout
    assert not (run.out / MARKER).exists()  # the resumed run clears it
    whole = run_recipe(*ARGS, out=tmp_path / "whole", launcher="python")
    assert resumed.comparable() == whole.comparable()
    for key in ("steps", "train_loss", "val_loss", "val_accuracy"):
        assert resumed.summary()[key] == whole.summary()[key], key


def test_the_recipe_restores_the_signal_handlers_it_found(tmp_path, capsys, fresh_accelerate_state):
    """Run in-process (as tests and notebooks do), the recipe leaves SIGTERM, SIGHUP, SIGUSR1 and SIGINT as they
    were, so that `timeout pytest` or a CI limit can still stop the suite."""
    from helpers import run_in_process

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGINT)}
    run = run_in_process(["--max_steps", "3", "--mixed_precision", "no", "--output_dir", tmp_path / "r"], capsys)
    assert run.returncode == 0, run.stderr
    assert {s: signal.getsignal(s) for s in before} == before
