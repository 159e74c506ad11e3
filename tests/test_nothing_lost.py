"""Nothing a user types or a machine does loses a run: a tracker that cannot start is refused in one line
before the run folder is touched (every file of the run unchanged), and a disk that refuses summary.json or
metrics.png at the very end ends the run in one line (exit 74) without a temporary file; the same command then
resumes from the newest good checkpoint and finishes."""
import json
import os
import shutil
import subprocess

import pytest

from helpers import assert_one_line_error, run_in_process, run_recipe, snapshot
from test_tracking import assert_png

pytestmark = pytest.mark.slow
BASE = ["--max_steps", "20", "--checkpointing_steps", "10", "--checkpoints_total_limit", "5", "--log_every", "5",
        "--mixed_precision", "no", "--warmup_steps", "4"]
NO_LOGIN = {"WANDB_MODE": "offline"}  # the refusals come before W&B would start; never online from a test


def recipe(*args, out, **kwargs):
    return run_recipe(*BASE, *args, out=out, launcher="python", **kwargs)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    recipe(out=out)
    return out


# --- a tracker that cannot start: refused before the run folder is touched --------------------------------------

def put_a_file(path):
    path.write_text("the user's notes, not a tracker's folder\n")


def put_a_broken_link(path):
    path.symlink_to(path.parent / "gone")


IN_THE_WAY = {"a file": (put_a_file, "a file, not a folder"), "a broken link": (put_a_broken_link, "a broken link")}
AGAIN = {"overwrite": ("--overwrite_output_dir",),
         "resume": ("--resume_from_checkpoint", "latest", "--max_steps", "30")}


@pytest.mark.parametrize("again", list(AGAIN))
@pytest.mark.parametrize("tracker,kind", [("tensorboard", "a file"), ("wandb", "a file"), ("wandb", "a broken link")])
def test_something_where_a_tracker_writes_is_refused_and_the_run_is_unchanged(finished, tmp_path, tracker, kind,
                                                                               again):
    out = tmp_path / "run"
    shutil.copytree(finished, out, symlinks=True)
    make, words = IN_THE_WAY[kind]
    make(out / tracker)
    before = snapshot(out)
    run = recipe("--report_to", tracker, *AGAIN[again], out=out, check=False, env=NO_LOGIN)
    line = assert_one_line_error(run, f"--report_to {tracker}", str(out / tracker), words, "move it away")
    assert snapshot(out) == before and (out / tracker).is_symlink() == (kind == "a broken link"), line


def test_a_read_only_tracker_folder_is_refused_and_the_run_is_unchanged(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    board = out / "tensorboard"
    board.mkdir()
    if subprocess.run(["mount", "--bind", str(board), str(board)], capture_output=True).returncode:
        pytest.skip("a read-only bind mount needs root")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(board)], check=True)
        before = snapshot(out)
        run = recipe("--report_to", "all", *AGAIN["resume"], out=out, check=False, env=NO_LOGIN)
    finally:
        subprocess.run(["umount", str(board)], check=False)
    assert_one_line_error(run, "--report_to all", str(board), "cannot be written")
    assert snapshot(out) == before


def test_a_wandb_variable_that_wandb_refuses_is_one_line_before_the_run_folder(tmp_path, capsys, monkeypatch,
                                                                                fresh_accelerate_state):
    """wandb.init would refuse it after the folder opened (a warning, W&B off): refused up front instead."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_BASE_URL", "api.example.com")
    out = tmp_path / "run"
    run = run_in_process(["--report_to", "wandb", "--max_steps", "2", "--output_dir", out], capsys)
    assert_one_line_error(run, "W&B refuses WANDB_BASE_URL='api.example.com'", "fix it or unset it")
    monkeypatch.setenv("WANDB_BASE_URL", "https://api.example.com")
    monkeypatch.setenv("WANDB_API_KEY", "secret-value")
    monkeypatch.setenv("WANDB_HTTP_TIMEOUT", "soon")
    run = run_in_process(["--report_to", "wandb", "--max_steps", "2", "--output_dir", out], capsys)
    line = assert_one_line_error(run, "W&B refuses WANDB_HTTP_TIMEOUT='soon'")
    assert "secret-value" not in line and not out.exists()


# --- a disk that refuses the end of the run ----------------------------------------------------------------------

@pytest.mark.parametrize("trouble", ["disk_full_at", "disk_read_only_at"])
@pytest.mark.parametrize("name", ["summary.json", "metrics.png"])
def test_a_disk_that_refuses_the_end_of_the_run_is_one_line_and_the_same_command_finishes_it(finished, small_disk,
                                                                                             trouble, name):
    out = small_disk / "run"
    shutil.copytree(finished, out)
    command = ("--resume_from_checkpoint", "latest", "--max_steps", "30")
    try:
        refused = recipe(*command, out=out, check=False, faults=f"{trouble}={name}")
    finally:
        subprocess.run(["umount", str(out)], capture_output=True, check=False)  # disk_read_only_at's bind mount
        (small_disk / "filler").unlink(missing_ok=True)
    reason = "No space left on device" if trouble == "disk_full_at" else "Read-only file system"
    line = assert_one_line_error(refused, reason, name, "--resume_from_checkpoint latest", code=74)
    assert not [p.name for p in out.rglob(".*tmp*")], line
    assert (out / "checkpoints" / "step_0000030").is_dir()

    again = recipe(*command, out=out)
    assert "Traceback" not in again.stderr and not [p.name for p in out.rglob(".*tmp*")]
    summary = again.summary()
    assert summary["steps"] == 30 and summary["status"] == "completed" and summary["train_loss"] is not None
    assert (out / "metrics.png").stat().st_mtime >= (out / "summary.json").stat().st_mtime
    assert_png(out / "metrics.png")
    evals = [r["step"] for r in again.eval_records()]
    assert evals == sorted(set(evals)) and evals[-1] == 30 and summary["val_loss"] == again.eval_records()[-1][
        "val_loss"]
    if name == "metrics.png":  # summary.json was written: the run is finished, only its picture is drawn
        assert "finished at step 30: nothing to train" in again.stdout
        assert json.loads((out / "summary.json").read_text()) == summary
    else:
        assert "at step 30" in again.stdout and (out / "model.safetensors").is_file()
    assert os.access(out, os.W_OK)


def test_which_finished_runs_owe_their_end(tmp_path):
    """A resume of a run's final checkpoint writes the end again only when it is owed: summary.json missing, not
    a completed run's (a halted job's: it has no steps), an earlier step's, or its export refused; a later
    step's end (the run was extended, and this is an older checkpoint) and this step's are left alone."""
    from mixprec.training.startup import _owed

    cases = [(None, "not this step's"), ({"status": "halted", "halted_at_step": 15}, "not this step's"),
             ({"status": "completed", "steps": 10}, "not this step's"), ({"status": "completed", "steps": 20}, None),
             ({"status": "completed", "steps": 30}, None),
             ({"status": "completed", "steps": 20, "hf_export": {"status": "refused"}}, "export was refused")]
    for summary, owed in cases:
        (tmp_path / "summary.json").unlink(missing_ok=True)
        if summary is not None:
            (tmp_path / "summary.json").write_text(json.dumps(summary))
        found = _owed(tmp_path, 20)
        assert (found is None) if owed is None else (owed in found), (summary, found)


def test_an_export_cut_short_by_the_disk_leaves_the_previous_export_and_no_temporary_folder(tmp_path):
    """save_pretrained writes into a hidden folder renamed into place: a refused write keeps what was there."""
    import errno

    from mixprec.models.hf_export import save_whole

    folder = tmp_path / "hf_model"
    save_whole(folder, lambda tmp: (tmp.mkdir(), (tmp / "config.json").write_text("{}")))

    def refused(tmp):
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "model.safetensors"))

    with pytest.raises(OSError):
        save_whole(folder, refused)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_model"]
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "mixprec_export.json"]


def test_an_export_whose_rename_fails_keeps_the_previous_export_whole(tmp_path, monkeypatch):
    """The previous export is moved aside, never deleted, before the new one is renamed in."""
    from mixprec.models.hf_export import save_whole

    folder = tmp_path / "hf_model"
    save_whole(folder, lambda tmp: (tmp.mkdir(), (tmp / "config.json").write_text("old")))
    real = os.replace

    def refuse_the_new_one(src, dst):
        if str(src).endswith(".hf_model.tmp"):
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(os, "replace", refuse_the_new_one)
    with pytest.raises(OSError):
        save_whole(folder, lambda tmp: (tmp.mkdir(), (tmp / "config.json").write_text("new")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_model"]
    assert (folder / "config.json").read_text() == "old"
    monkeypatch.setattr(os, "replace", real)
    real(folder, tmp_path / ".hf_model.old")  # as a crash between the two renames leaves it
    save_whole(folder, lambda tmp: (tmp.mkdir(), (tmp / "config.json").write_text("new")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_model"]
    assert (folder / "config.json").read_text() == "new"
