"""slurm/train.sbatch, unchanged, on a real two-node SLURM cluster started on this machine (tests/slurm_cluster.py):
a 1-node job, a 2-node job with world size 2, and a job preempted twice (SIGUSR1 as before the time limit,
then a requeue by SLURM with SIGTERM) that resumes and ends exactly like the uninterrupted job."""
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from helpers import REPO, base_env, hooks_env, without_timings
from slurm_cluster import SlurmCluster, missing_binaries

TEMPLATE = REPO / "slurm" / "train.sbatch"
ARGS = ["--max_steps", "60", "--log_every", "10", "--mixed_precision", "no"]
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def template_port(job_id: int) -> int:
    """The template's rule for MASTER_PORT; test_one_node_job_completes checks the template still uses it."""
    return 15000 + job_id % 15000


@pytest.fixture(scope="module")
def cluster():
    missing = missing_binaries()
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge "
                    f"(.ci/run does)")
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs its own slurmctld and slurmd as root (SlurmUser=root): run as root")
    c = SlurmCluster(template_port=template_port)
    try:
        yield c.start()
    finally:
        c.stop()
        leftovers = [name for name, p in c.procs.items() if p.poll() is None] + c.leftover_pids()
        c.cleanup()
        assert not leftovers, f"processes left running after the cluster stopped: {leftovers}"


class Job:
    def __init__(self, cluster: SlurmCluster, workdir: Path, job_id: str):
        self.cluster, self.workdir, self.id = cluster, workdir, job_id

    @property
    def log(self) -> str:
        path = self.workdir / "logs" / f"mixprec-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    @property
    def run_dir(self) -> Path:
        return self.workdir / "runs" / f"mixprec-{self.id}"

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def metrics(self) -> list[dict]:
        lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        return without_timings([json.loads(line) for line in lines if line])

    def info(self) -> dict:
        return self.cluster.job(self.id)

    def fail(self, why: str):
        pytest.fail(f"job {self.id}: {why}\n--- job log\n{self.log[-6000:]}\n--- cluster\n{self.cluster.logs()}")

    def wait_done(self, timeout: float = 240) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.info()
            if info.get("JobState") in DONE:
                return info
            time.sleep(1)
        self.fail(f"not finished after {timeout} s (state {self.info().get('JobState')})")

    def wait_for(self, text: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log:
                return
            if self.info().get("JobState") in DONE:
                self.fail(f"ended before '{text}' appeared")
            time.sleep(0.5)
        self.fail(f"no '{text}' after {timeout} s")


def submit(cluster: SlurmCluster, workdir: Path, *recipe_args, sbatch_args=(), env=None) -> Job:
    """sbatch the repository's template as it is. --chdir keeps logs/ and runs/ in `workdir`."""
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    cmd = ["sbatch", "--parsable", f"--chdir={workdir}", *sbatch_args, str(TEMPLATE), *map(str, recipe_args)]
    proc = subprocess.run(cmd, cwd=REPO, env={**base_env(env), "SLURM_CONF": str(cluster.conf)},
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return Job(cluster, workdir, proc.stdout.strip().split(";")[0])


def release_when_signalled(job: Job, release: Path, step: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not (release / "signalled-0").exists():
        if time.monotonic() > deadline:
            job.fail(f"the signal never reached the paused run at step {step}")
        time.sleep(0.1)
    (release / str(step)).touch()


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    job = submit(cluster, tmp_path_factory.mktemp("one-node"), *ARGS)
    job.final = job.wait_done()
    return job


@pytest.mark.slow
def test_one_node_job_completes(uninterrupted):
    job, info = uninterrupted, uninterrupted.final
    if (info["JobState"], info["ExitCode"]) != ("COMPLETED", "0:0"):
        job.fail(f"state {info['JobState']}, exit code {info['ExitCode']}")
    summary = job.summary()
    assert summary["steps"] == 60 and summary["world_size"] == 1
    losses = [r["loss"] for r in job.metrics() if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]
    log = job.log
    assert f"mixprec: job {job.id} (mixprec), attempt 1" in log
    assert f"master     n1:{template_port(int(job.id))}" in log
    assert re.search(r"^0 +n1 +\S+ +cpu: \d+ cores", log, re.M)  # the node table
    assert "1 process(es) per node on cpu, world size 1" in log
    assert "resume: no checkpoint in" in log  # --resume_from_checkpoint latest on a fresh folder
    assert "done: 60 steps" in log


@pytest.mark.slow
def test_two_node_job_trains_with_world_size_2_across_both_nodes(cluster, tmp_path_factory):
    job = submit(cluster, tmp_path_factory.mktemp("two-nodes"), *ARGS, sbatch_args=["--nodes=2"])
    info = job.wait_done()
    if (info["JobState"], info["ExitCode"]) != ("COMPLETED", "0:0"):
        job.fail(f"state {info['JobState']}, exit code {info['ExitCode']}")
    assert info["NodeList"] == "n[1-2]" and info["NumNodes"] == "2"
    assert job.summary()["world_size"] == 2 and job.summary()["steps"] == 60
    log = job.log
    rows = re.findall(r"^(\d) +(n\d) +\S+ +cpu: ", log, re.M)
    assert rows == [("0", "n1"), ("1", "n2")], rows  # the node table, one row written on each node
    assert "[n1] node rank 0 of 2" in log and "[n2] node rank 1 of 2" in log  # each node read its own rank
    assert "processes      2 (MULTI_CPU, backend gloo)" in log


@pytest.mark.slow
def test_preempted_job_is_requeued_resumes_and_matches_the_uninterrupted_one(cluster, uninterrupted,
                                                                             tmp_path_factory):
    # The run pauses after steps 20 and 40 (tests/faults.py) so that each signal surely lands mid-training; it
    # goes on once it has the signal.
    workdir, release = tmp_path_factory.mktemp("preempted"), tmp_path_factory.mktemp("release")
    job = submit(cluster, workdir, *ARGS, env=hooks_env(faults="pause_at_step=20,pause_at_step=40", release=release))
    # 1. What --signal=USR1@120 does before the time limit: SIGUSR1 to every job step, not the batch shell.
    job.wait_for("[test hook] paused at step 20")
    subprocess.run(["scancel", "--signal=USR1", job.id], env=cluster.env, check=True)
    release_when_signalled(job, release, 20)
    # 2. What a preemption with PreemptMode=REQUEUE does: SIGTERM to everything, SIGKILL after KillWait,
    #    and SLURM puts the job back in the queue itself.
    job.wait_for("[test hook] paused at step 40")
    (release / "signalled-0").unlink()
    subprocess.run(["scontrol", "requeue", job.id], env=cluster.env, check=True)
    release_when_signalled(job, release, 40)
    info = job.wait_done()
    if (info["JobState"], info["ExitCode"], info["Restarts"]) != ("COMPLETED", "0:0", "2"):
        job.fail(f"state {info['JobState']}, exit code {info['ExitCode']}, restarts {info['Restarts']}")

    log = job.log  # --open-mode=append: every attempt's output is in the one log
    assert [int(n) for n in re.findall(rf"mixprec: job {job.id} \(mixprec\), attempt (\d)", log)] == [1, 2, 3]
    assert "preempted (SIGUSR1): saved" in log and "at step 20; exiting with code 75" in log
    assert f"requeueing job {job.id}" in log  # the template requeued after SIGUSR1
    assert "preempted (SIGTERM): saved" in log and "at step 40; exiting with code 75" in log
    assert "resumed from" in log and "at step 20 (epoch 0, batch 20)" in log and "at step 40 (epoch 0, batch 40)" in log
    assert not (job.run_dir / "preempted.json").exists()
    assert job.metrics() == uninterrupted.metrics()  # every logged loss, lr, grad norm and the evaluation
    for key in ("steps", "train_loss", "val_loss", "val_accuracy", "world_size"):
        assert job.summary()[key] == uninterrupted.summary()[key], key


def test_shellcheck_passes_on_every_script_in_slurm():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed: apt-get install shellcheck (.ci/run does)")
    scripts = [p for p in sorted((REPO / "slurm").iterdir()) if p.read_bytes().startswith(b"#!")]
    assert TEMPLATE in scripts
    proc = subprocess.run(["shellcheck", "--severity=style", *map(str, scripts)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_template_refuses_to_run_outside_slurm_and_flags_it_owns():
    outside = subprocess.run(["bash", str(TEMPLATE)], env=base_env(), capture_output=True, text=True, cwd=REPO)
    assert outside.returncode == 2 and outside.stderr.startswith("error: this is a SLURM batch script")
    fake_job = base_env({"SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(REPO)})
    for flag in ("--output_dir", "--resume_from_checkpoint=latest", "--overwrite_output_dir"):
        proc = subprocess.run(["bash", str(TEMPLATE), "--max_steps", "5", flag], env=fake_job, capture_output=True,
                              text=True, cwd=REPO)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert flag in proc.stderr and "set RUN_DIR=FOLDER instead" in proc.stderr
