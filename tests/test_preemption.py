"""Preemption without SLURM: a signal mid-training gives a checkpoint, preempted.json and exit code 75, and
resuming ends exactly where an uninterrupted run ends. With two processes, a signal to one stops both."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mixprec.preemption import EXIT_CODE, MARKER
from tests.conftest import REPO, TRAIN, base_env, run_recipe
from tests.slurm_cluster import free_port

pytestmark = pytest.mark.slow
ARGS = ["--max_steps", "60", "--log_every", "10", "--mixed_precision", "no"]
PAUSED = "pause_at_step=20: waiting for a signal"




def pids(needle: str, rank: int | None = None) -> list[int]:
    """Recipe processes whose command line contains `needle` (and whose environment has RANK=rank)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in cmdline and "train.py" in cmdline and (rank is None or f"RANK={rank}".encode() in environ):
            found.append(int(entry.name))
    return found


@pytest.fixture
def start(tmp_path):
    """Start a command with its output in a log file. At the end, whatever it left running is killed, by pid
    (torchrun starts its workers in sessions of their own, so a process group would not reach them)."""
    procs = []

    def _start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=base_env(env)))
        return procs[-1]

    yield _start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for pid in pids(str(tmp_path)):
        os.kill(pid, signal.SIGKILL)


def wait_for_line(proc: subprocess.Popen, log: Path, text: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text():
            return
        if proc.poll() is not None:
            pytest.fail(f"exited {proc.returncode} before '{text}':\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    pytest.fail(f"no '{text}' after {timeout} s:\n{log.read_text()[-4000:]}")


def test_sigterm_mid_training_checkpoints_exits_75_and_the_resumed_run_matches(tmp_path, start):
    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = start([sys.executable, str(TRAIN), *ARGS, "--output_dir", str(out)], log,
                 {"MIXPREC_FAULTS": "pause_at_step=20"})
    wait_for_line(proc, log, PAUSED)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == EXIT_CODE == 75, log.read_text()[-4000:]
    marker = json.loads((out / MARKER).read_text())
    assert (marker["signal"], marker["step"], marker["exit_code"]) == ("SIGTERM", 20, 75)
    assert (out / "checkpoints" / "latest").read_text() == "step_0000020"  # saved at the signal, not before
    assert not (out / "summary.json").exists()
    assert "preempted (SIGTERM): saved" in log.read_text()

    resumed = run_recipe(*ARGS, "--resume_from_checkpoint", "latest", out=out, launcher="python")
    assert "at step 20 (epoch 0, batch 20)" in resumed.stdout
    assert not (out / MARKER).exists()  # the resumed run clears it
    whole = run_recipe(*ARGS, out=tmp_path / "whole", launcher="python")
    assert resumed.comparable() == whole.comparable()
    for key in ("steps", "train_loss", "val_loss", "val_accuracy"):
        assert resumed.summary()[key] == whole.summary()[key], key


def test_a_signal_to_one_of_two_processes_stops_both_after_the_same_step(tmp_path, start):
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
           "--mixed_precision", "no", "--dynamo_backend", "no", str(TRAIN), *ARGS, "--output_dir", str(out)]
    proc = start(cmd, log, {"MIXPREC_FAULTS": "pause_at_step=20", "ACCELERATE_USE_CPU": "true",
                            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGINT"})
    wait_for_line(proc, log, PAUSED)
    (rank1,) = pids(str(out), rank=1)
    os.kill(rank1, signal.SIGUSR1)  # rank 0 gets nothing: it stops because the flag is reduced over ranks
    assert proc.wait(60) != 0, log.read_text()[-4000:]  # accelerate launch turns 75 into 1
    marker = json.loads((out / MARKER).read_text())
    assert marker["step"] == 20 and marker["signal"] == "another process's signal"
    ckpt = out / "checkpoints" / "step_0000020"
    assert (out / "checkpoints" / "latest").read_text() == ckpt.name
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in ckpt.iterdir()}  # both ranks saved
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 20
