"""Checkpoints: a run killed with SIGKILL and resumed ends exactly where an uninterrupted run ends."""
import json

import pytest

from helpers import run_recipe

pytestmark = pytest.mark.slow
# 3 epochs of 200 batches, accumulation 3: 66 steps per epoch (the 2 batches that do not fill a window are left
# out), 198 in all
ARGS = ["--num_epochs", "3", "--gradient_accumulation_steps", "3", "--checkpointing_steps", "50",
        "--log_every", "10", "--eval_steps", "25"]


@pytest.mark.parametrize("mp", ["no", "fp16"])  # bf16 (no state of its own): tests/test_matrix.py
def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, mp):
    args = [*ARGS, "--mixed_precision", mp]
    whole = run_recipe(*args, out=tmp_path / "whole")
    # killed at step 120: the latest checkpoint is step 100, in the middle of epoch 1
    killed = run_recipe(*args, out=tmp_path / "killed", faults="kill_at_step=120", check=False)
    assert killed.returncode != 0 and not (tmp_path / "killed" / "summary.json").exists()
    assert (tmp_path / "killed" / "checkpoints" / "latest").read_text() == "step_0000100"
    resumed = run_recipe(*args, "--resume_from_checkpoint", "latest", out=tmp_path / "killed")
    assert "resumed from" in resumed.stdout and "at step 100 (epoch 1, batch 102)" in resumed.stdout
    assert resumed.comparable() == whole.comparable()  # every logged loss, lr, grad norm and evaluation
    for key in ("steps", "train_loss", "val_loss", "val_accuracy", "skipped_steps"):
        assert resumed.summary()[key] == whole.summary()[key], key


def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path):
    out = tmp_path / "r"
    crashed = run_recipe(*ARGS, "--mixed_precision", "no", out=out, launcher="python",
                         faults="kill_during_save=150", check=False)
    assert crashed.returncode != 0
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_0000100"
    assert (ckpts / ".tmp-step_0000150").is_dir() and not (ckpts / "step_0000150").exists()
    resumed = run_recipe(*ARGS, "--mixed_precision", "no", "--resume_from_checkpoint", "latest", out=out,
                         launcher="python")
    assert "at step 100" in resumed.stdout and resumed.summary()["steps"] == 198
    assert not (ckpts / ".tmp-step_0000150").exists()  # the half-written one is cleaned up
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_0000150", "step_0000198"]  # keeps 2
    state = json.loads((ckpts / "step_0000198" / "trainer_state.json").read_text())
    assert (state["step"], state["epoch"], state["batches_done"]) == (198, 3, 0)


def test_resume_a_specific_checkpoint_folder(tmp_path):
    first = run_recipe("--num_epochs", "1", "--checkpointing_steps", "100", "--mixed_precision", "no",
                       out=tmp_path / "a", launcher="python")
    ckpt = tmp_path / "a" / "checkpoints" / "step_0000100"
    assert ckpt.is_dir() and first.summary()["steps"] == 200
    second = run_recipe("--num_epochs", "1", "--checkpointing_steps", "100", "--mixed_precision", "no",
                        "--resume_from_checkpoint", ckpt, out=tmp_path / "b", launcher="python")
    assert second.summary()["val_loss"] == first.summary()["val_loss"]
    assert [r["step"] for r in second.train_records()] == [150, 200]  # a new folder: only what it trained
