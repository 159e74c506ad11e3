"""CPU threads (mixprec.devices.threads): the lesson's MLP on one thread, larger models on the usable cores, the
user's --cpu_threads as given, and a resume on the count its checkpoint recorded, so that a run resumed where
another count would be chosen (another machine, another --cpu_threads before) continues the same numbers (bf16
results differ between thread counts). Real runs; nothing timed."""
import json
import shutil
import subprocess
import sys

import pytest

from helpers import REPO, TRAIN, base_env
from mixprec.devices import threads

GPT_TINY = REPO / "recipes" / "configs" / "gpt_tiny.yaml"


def test_the_count_follows_the_model_the_user_and_the_checkpoint():
    cores = threads.usable_cores()
    assert threads.choose(None, 0.01)[0] == 1  # the MLP's work: one thread
    assert threads.choose(None, 1.0)[0] == cores
    assert threads.choose(3, 1.0) == (3, "--cpu_threads")  # the user's count is the user's
    count, why = threads.choose(None, 1.0, recorded=2)
    assert count == 2 and why.startswith("as recorded by the checkpoint")
    assert threads.choose(None)[0] == cores  # provisional, before the model is known


def _run(args, out, cores: str | None = None):
    """The recipe in one process, on the CPUs `cores` names (taskset: what this machine would choose on them)."""
    prefix = ["taskset", "-c", cores] if cores else []
    proc = subprocess.run([*prefix, sys.executable, str(TRAIN), *map(str, args), "--output_dir", str(out)],
                          capture_output=True, text=True, env=base_env(), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(threads.usable_cores() < 2 or not shutil.which("taskset"), reason="needs 2 cores and taskset")
def test_a_resume_where_another_count_would_be_chosen_keeps_the_checkpoints_and_its_numbers(tmp_path):
    args = ("--config", GPT_TINY, "--mixed_precision", "bf16", "--log_every", "2", "--checkpointing_steps", "2",
            "--batch_size", "8")
    whole = _run([*args, "--max_steps", "6"], tmp_path / "whole", cores="0")  # one usable core: 1 thread chosen
    first = _run([*args, "--max_steps", "2"], tmp_path / "cut", cores="0")
    assert "threads        1 per process (1 usable cores" in whole and "threads        1 per process (1 usable" in first
    resumed = _run([*args, "--max_steps", "6", "--resume_from_checkpoint", "latest"], tmp_path / "cut")  # all cores
    assert "threads        1 per process (as recorded by the checkpoint" in resumed
    losses = [[r["loss"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
               if "loss" in r and "event" not in r] for name in ("whole", "cut")]
    assert losses[0] == losses[1] and len(losses[0]) == 3
