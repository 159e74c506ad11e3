"""CPU threads on a busy machine (mixprec.devices.threads): no more threads than the cores other processes leave
free when the run starts, the lesson's MLP on one thread whatever the load, and a resume on the count its
checkpoint recorded, so that a run resumed on a machine that got busier or quieter continues the same numbers
(bf16 results differ between thread counts). Real busy processes (spinning Python), real runs; nothing timed."""
import json
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from helpers import REPO, run_recipe
from mixprec.devices import threads

GPT_TINY = REPO / "recipes" / "configs" / "gpt_tiny.yaml"
SPIN = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end:\n    pass\n"


@contextmanager
def busy(count: int):
    """`count` processes spinning on a core each, until the block ends (at most two minutes)."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
    try:
        time.sleep(0.5)  # running, not starting
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_the_count_leaves_the_busy_cores_to_their_processes_and_small_work_stays_on_one_thread(monkeypatch):
    monkeypatch.setenv("MIXPREC_LOAD_AWARE_THREADS", "1")
    cores = threads.usable_cores()
    with busy(cores):
        assert threads.busy_cores() >= cores
        count, why = threads.choose(None, 1.0)
        assert count == 1 and "other processes running" in why and "1 thread per process" in why
        assert threads.choose(None, 0.01)[0] == 1  # the MLP's work: one thread, busy or not
        assert threads.choose(3, 1.0) == (3, "--cpu_threads")  # the user's count is the user's
        assert threads.choose(None, 1.0, recorded=2)[0] == 2  # a resume keeps its checkpoint's
        assert threads.choose(None)[0] == max(1, cores)  # provisional, before the model is known: not sampled
        monkeypatch.setenv("MIXPREC_LOAD_AWARE_THREADS", "0")
        assert threads.choose(None, 1.0)[0] == cores  # the model alone decides


@pytest.mark.slow
def test_a_resume_on_a_quieter_machine_keeps_the_checkpoints_thread_count_and_its_numbers(tmp_path):
    args = ("--config", GPT_TINY, "--mixed_precision", "bf16", "--log_every", "2", "--checkpointing_steps", "2",
            "--batch_size", "8")
    aware = {"MIXPREC_LOAD_AWARE_THREADS": "1"}  # the default (the test helpers turn it off for the suite)
    with busy(threads.usable_cores()):
        whole = run_recipe(*args, "--max_steps", "6", out=tmp_path / "whole", launcher="python", env=aware)
        first = run_recipe(*args, "--max_steps", "2", out=tmp_path / "cut", launcher="python", env=aware)
    assert "threads        1 per process" in whole.stdout and "threads        1 per process" in first.stdout
    resumed = run_recipe(*args, "--max_steps", "6", "--resume_from_checkpoint", "latest", out=tmp_path / "cut",
                         launcher="python", env=aware)
    assert "threads        1 per process (as recorded by the checkpoint" in resumed.stdout
    losses = [[r["loss"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
               if "loss" in r and "event" not in r] for name in ("whole", "cut")]
    assert losses[0] == losses[1] and len(losses[0]) == 3
    config = (tmp_path / "cut" / "config.yaml").read_text()
    assert "as recorded by the checkpoint" in config
