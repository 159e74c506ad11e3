"""The run folder is the user's data: one run at a time (a lock the kernel releases), resumes that refuse what
they cannot honour and make allowed changes real, checkpoints that know when they are damaged, and a full or
read-only disk that costs nothing but the checkpoint being written."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import REPO, TRAIN, assert_one_line_error, base_env, hooks_env, run_recipe, snapshot
from mixprec.optim import lr_factor

pytestmark = pytest.mark.slow
BASE = ["--max_steps", "20", "--checkpointing_steps", "10", "--checkpoints_total_limit", "5", "--log_every", "5",
        "--mixed_precision", "no", "--warmup_steps", "4"]


def recipe(*args, out, **kwargs):
    return run_recipe(*BASE, *args, out=out, launcher="python", **kwargs)


class Paused:
    """A run started in the background that pauses at `step` (tests/faults.py) until `release()`."""

    def __init__(self, out: Path, tmp: Path, step: int, *args):
        self.folder, self.step, self.log = tmp / f"release-{step}", step, tmp / f"paused-{step}.log"
        self.folder.mkdir()
        env = hooks_env(faults=f"pause_at_step={step}", release=self.folder)
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, str(TRAIN), *BASE, *args, "--output_dir", str(out)],
                                         stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=base_env(env))
        deadline = time.monotonic() + 300
        while f"[test hook] paused at step {step}" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no pause (exit {self.proc.poll()}):\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def release(self) -> int:
        (self.folder / str(self.step)).touch()
        return self.proc.wait(300)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# --- one run per folder ---------------------------------------------------------------------------------------

def test_a_second_run_on_the_same_folder_stops_at_once_and_the_first_completes(tmp_path):
    out = tmp_path / "run"
    first = Paused(out, tmp_path, 7)
    try:
        second = recipe("--resume_from_checkpoint", "latest", out=out, check=False)
        line = assert_one_line_error(second, str(out), "in use by another run", f"pid {first.proc.pid}")
        assert "wait for it to end" in line
        assert first.release() == 0, first.log.read_text()[-3000:]
    finally:
        first.kill()
    records = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [5, 10, 15, 20]  # every row of the first run


def test_a_killed_run_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "run"
    killed = Paused(out, tmp_path, 12)
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait()
    resumed = recipe("--resume_from_checkpoint", "latest", out=out)
    assert "resumed from" in resumed.stdout and "at step 10" in resumed.stdout and resumed.summary()["steps"] == 20


# --- the resume contract ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    recipe(out=out)
    return out


def copy_of(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def test_changed_settings_are_refused_with_each_change_and_the_fix(finished):
    before = snapshot(finished)
    run = recipe("--resume_from_checkpoint", "latest", "--lr", "3e-4", "--seed", "7", "--batch_size", "16",
                 out=finished, check=False)
    line = assert_one_line_error(run, "global_batch: 32 -> 16", "seed: 42 -> 7", "lr: 0.001 -> 0.0003",
                                 "start a new --output_dir", "--allow_config_change global_batch,lr",
                                 "seed cannot change within a run")
    assert "step_0000020" in line
    run = recipe("--resume_from_checkpoint", "latest", "--model_args", "hidden=[64]", out=finished, check=False)
    assert_one_line_error(run, "model_args: {'hidden': [256, 128]} -> {'hidden': [64]}")
    run = recipe("--resume_from_checkpoint", "latest", "--mixed_precision", "fp16", out=finished, check=False)
    assert_one_line_error(run, "mixed_precision: no -> fp16", "cannot change within a run")
    assert snapshot(finished) == before


def test_a_changed_train_file_is_refused_and_the_same_content_is_not(tmp_path):
    """--train_file is part of the trajectory by its fingerprint: a small file by its content, a folder by its
    files' names, sizes and times."""
    from mixprec.run_folder import resume
    from mixprec.errors import UsageError

    data = tmp_path / "train.txt"
    data.write_text("def f():\n    return 1\n")
    first = resume.fingerprint(str(data))
    data.write_text("def f():\n    return 1\n")  # written again, the same content
    assert resume.fingerprint(str(data)) == first and resume.fingerprint(None) is None
    data.write_text("def f():\n    return 2\n")  # the same size, another content
    changed = resume.fingerprint(str(data))
    assert changed != first
    with pytest.raises(UsageError, match=f"train_file: {first} -> {changed}: start a new --output_dir "
                                         r"\(train_file cannot change within a run\)"):
        resume.compare({"train_file": first}, {"train_file": changed}, [], tmp_path / "step_0000010")
    folder = tmp_path / "images"
    (folder / "cat").mkdir(parents=True)
    (folder / "cat" / "a.png").write_bytes(b"png")
    before = resume.fingerprint(str(folder))
    (folder / "cat" / "b.png").write_bytes(b"png")
    assert resume.fingerprint(str(folder)) != before


def test_resuming_a_finished_run_says_so_and_touches_nothing(finished):
    before = snapshot(finished)
    run = recipe("--resume_from_checkpoint", "latest", out=finished)
    assert "finished at step 20: nothing to train" in run.stdout
    assert snapshot(finished) == before and json.loads((finished / "summary.json").read_text())["train_loss"]


def test_an_allowed_lr_change_takes_effect_from_the_resume_step_and_is_recorded(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    shutil.rmtree(out / "checkpoints" / "step_0000020")  # continue from step 10
    run = recipe("--resume_from_checkpoint", "latest", "--lr", "3e-4", "--allow_config_change", "lr", out=out)
    assert "resume: lr 0.001 -> 0.0003, from step 11 on" in run.stdout
    lr = {r["step"]: r["lr"] for r in run.train_records()}
    for step in (15, 20):  # the lr logged is the lr of the step: the schedule at step - 1, from the new peak
        assert lr[step] == pytest.approx(3e-4 * lr_factor(step - 1, 4, 20, "cosine", 0.1), rel=1e-12)
    assert lr[5] == pytest.approx(1e-3 * lr_factor(4, 4, 20, "cosine", 0.1), rel=1e-12)  # before: as it was
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["config"]["lr"] == 3e-4
    started, resumed = config["history"]
    assert started["event"] == "started" and resumed["event"] == "resumed" and resumed["step"] == 10
    assert resumed["changed"] == {"lr": "0.001 -> 0.0003"} and resumed["from_checkpoint"].endswith("step_0000010")


def test_a_longer_run_keeps_the_schedule_and_says_so(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    run = recipe("--resume_from_checkpoint", "latest", "--max_steps", "30", out=out)
    assert "the learning-rate schedule keeps its 20 steps, and steps 21-30 run at its final rate 0.0001" in run.stdout
    assert [r["lr"] for r in run.train_records() if r["step"] > 20] == pytest.approx([1e-4, 1e-4])
    assert run.summary()["steps"] == 30
    assert yaml.safe_load((out / "config.yaml").read_text())["history"][-1]["note"].startswith("the run now ends")


def test_fp16_init_scale_changed_on_resume_is_the_scale_from_then_on(tmp_path):
    out = tmp_path / "run"
    recipe("--mixed_precision", "fp16", "--max_steps", "10", out=out)
    run = recipe("--mixed_precision", "fp16", "--resume_from_checkpoint", "latest", "--init_scale", "1024",
                 "--allow_config_change", "init_scale", out=out)
    scales = {r["step"]: r["loss_scale"] for r in run.train_records()}
    assert scales == {5: 65536.0, 10: 65536.0, 15: 1024.0, 20: 1024.0}


# --- damaged checkpoints -----------------------------------------------------------------------------------------

DAMAGE = {
    "cut short": ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:100]), "has 100 bytes, not"),
    "missing": ("optimizer.bin", lambda p: p.unlink(), "optimizer.bin is missing"),
    "garbage state": ("trainer_state.json", lambda p: p.write_text("{garbage"), "trainer_state.json"),
    "changed": ("random_states_0.pkl", lambda p: p.write_bytes(p.read_bytes()[:-1] + b"x"), "changed (checksum"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_good_one(finished, tmp_path, kind):
    out = copy_of(finished, tmp_path)
    name, damage, words = DAMAGE[kind]
    damage(out / "checkpoints" / "step_0000020" / name)
    run = recipe("--resume_from_checkpoint", "latest", "--max_steps", "30", out=out)
    (line,) = [x for x in run.stdout.splitlines() if "is damaged" in x]
    assert "step_0000020" in line and words in line and line.endswith("step_0000010")
    assert "at step 10" in run.stdout and run.summary()["steps"] == 30


def test_no_good_checkpoint_left_is_one_line(finished, tmp_path):
    out = copy_of(finished, tmp_path)
    for ckpt in (out / "checkpoints").glob("step_*"):
        (ckpt / "manifest.json").unlink()
    run = recipe("--resume_from_checkpoint", "latest", "--max_steps", "30", out=out, check=False)
    assert_one_line_error(run, "no checkpoint", "passes its manifest", "start a new --output_dir")


# --- a disk that refuses writes ----------------------------------------------------------------------------------

# `small_disk`: tests/conftest.py

@pytest.mark.parametrize("trouble", ["full", "read-only"])
def test_a_disk_that_refuses_the_checkpoint_is_one_line_and_the_last_checkpoint_resumes(small_disk, tmp_path,
                                                                                        trouble):
    out = small_disk / "run"
    paused = Paused(out, tmp_path, 15)
    filler = small_disk / "filler"
    try:
        if trouble == "full":
            subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)  # to the brim
        else:  # checkpoints/ read-only, for root too: a read-only bind mount over it
            ckpts = str(out / "checkpoints")
            subprocess.run(["mount", "--bind", ckpts, ckpts], check=True)
            subprocess.run(["mount", "-o", "remount,bind,ro", ckpts], check=True)
        code = paused.release()
    finally:
        paused.kill()
        subprocess.run(["umount", str(out / "checkpoints")], capture_output=True, check=False)
        filler.unlink(missing_ok=True)
    log = paused.log.read_text()
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert code == 74 and len(errors) == 1 and "Traceback" not in log, log[-3000:]
    reason = "No space left on device" if trouble == "full" else "Read-only file system"
    assert reason in errors[0] and "step_0000020" in errors[0] and "step_0000010 stays the latest" in errors[0]
    assert not list((out / "checkpoints").glob(".tmp-*")) or trouble == "read-only"
    resumed = recipe("--resume_from_checkpoint", "latest", out=out)
    assert "at step 10" in resumed.stdout and resumed.summary()["steps"] == 20
    assert not list((out / "checkpoints").glob(".tmp-*"))
    whole = recipe(out=tmp_path / "whole")
    assert resumed.comparable() == whole.comparable()


# --- something of the wrong kind where a checkpoint goes --------------------------------------------------------

def make_latest_a_folder(out: Path) -> None:
    (out / "checkpoints" / "latest").unlink()
    (out / "checkpoints" / "latest" / "notes").mkdir(parents=True)


def make_a_step_a_file(out: Path) -> None:
    (out / "checkpoints" / "step_0000030").write_text("the user's notes\n")


IN_THE_WAY = {"latest a folder": (make_latest_a_folder, "latest' is a folder"),
              "a step a file": (make_a_step_a_file, "step_0000030' is a file")}


@pytest.mark.parametrize("kind", list(IN_THE_WAY))
def test_something_of_the_wrong_kind_in_checkpoints_is_named_at_start(finished, tmp_path, kind):
    """Not "free space": the line names what is in the way, and nothing on disk changes."""
    out = copy_of(finished, tmp_path)
    make, words = IN_THE_WAY[kind]
    make(out)
    before = snapshot(out)
    run = recipe("--resume_from_checkpoint", "latest", "--max_steps", "30", out=out, check=False)
    line = assert_one_line_error(run, words, "move it away")
    assert "free space" not in line and snapshot(out) == before


@pytest.mark.parametrize("kind", list(IN_THE_WAY))
def test_something_of_the_wrong_kind_that_appears_during_the_run_is_named_and_leaves_no_temporary_file(tmp_path,
                                                                                                       kind):
    out = tmp_path / "run"
    paused = Paused(out, tmp_path, 25, "--max_steps", "30")
    try:
        IN_THE_WAY[kind][0](out)
        code = paused.release()
    finally:
        paused.kill()
    log = paused.log.read_text()
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert code == 74 and len(errors) == 1 and "Traceback" not in log, log[-3000:]
    assert IN_THE_WAY[kind][1] in errors[0] and "free space" not in errors[0], errors[0]
    assert not [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]


def test_a_failed_plot_leaves_no_temporary_file(finished, tmp_path):
    from mixprec.tracking.plots import plot_run

    out = copy_of(finished, tmp_path)
    (out / "metrics.png").unlink()
    (out / "metrics.png" / "notes").mkdir(parents=True)  # the picture cannot replace a folder
    with pytest.raises(OSError):
        plot_run(out)
    assert not (out / ".metrics.png.tmp").exists()


def test_unreadable_bytes_at_the_end_of_the_metrics_log_are_passed_over_with_a_word(finished, tmp_path):
    """A crash or a disk can leave bytes that are not UTF-8 at the end of metrics.jsonl: the resume keeps the
    records up to its checkpoint, says what it passed over, and the log reads as one run."""
    out = copy_of(finished, tmp_path)
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 21, "loss": \xff\xfe\x00\x9c\n\xc3\x28')
    resumed = recipe("--resume_from_checkpoint", "latest", "--max_steps", "30", out=out)
    assert "not UTF-8 text" in resumed.stderr and "Traceback" not in resumed.stderr
    steps = [r["step"] for r in resumed.train_records()]  # every line parses: the bytes are gone
    assert steps == sorted(steps) and steps[-1] == 30 and resumed.summary()["steps"] == 30


def test_a_full_disk_outside_a_checkpoint_is_one_line_and_exit_74_and_the_run_resumes(finished, small_disk, tmp_path):
    """config.yaml, metrics.jsonl and summary.json are written outside a checkpoint: a disk that refuses them ends
    the run the same way (one line, exit 74, no temporary file), and the next start resumes from the newest
    good checkpoint."""
    out = small_disk / "run"
    shutil.copytree(finished, out)
    filler = small_disk / "filler"
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=4k"], capture_output=True)  # to the brim
    try:
        full = recipe("--resume_from_checkpoint", "latest", "--max_steps", "30", out=out, check=False)
    finally:
        filler.unlink()
    line = assert_one_line_error(full, "No space left on device", "--resume_from_checkpoint latest", code=74)
    assert not [p.name for p in out.rglob(".*tmp*")], line
    resumed = recipe("--resume_from_checkpoint", "latest", "--max_steps", "30", out=out)
    assert "at step 20" in resumed.stdout and resumed.summary()["steps"] == 30


def test_every_file_of_a_run_is_readable_as_the_umask_says(tmp_path):
    """A run folder is shared on a cluster: model.safetensors and the checkpoints' safetensors files get the
    mode every other file gets (safetensors itself writes them 0600: compat.umask_modes). Under umask 027:
    0640 everywhere, neither 0600 nor a fixed 0644."""
    before = os.umask(0o027)
    try:
        run_recipe("--max_steps", "2", "--checkpointing_steps", "1", out=tmp_path / "run", launcher="python")
    finally:
        os.umask(before)
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file() and p.name != ".lock"]
    assert sum(p.suffix == ".safetensors" for p in files) >= 3  # the model and two checkpoints'
    assert {p.stat().st_mode & 0o777 for p in files} == {0o640}, {str(p): oct(p.stat().st_mode) for p in files}
