"""A real two-node SLURM cluster on one machine, for the tests of slurm/train.sbatch.

Debian's `slurm-wlm` and `munge` (installed by .ci/run) run here as a private cluster: its own munged
(own key and socket), one slurmctld and two slurmd (nodes n1 and n2 on 127.0.0.1 and 127.0.0.2), all on
free ports, with every state, spool, log and pid file in one scratch folder. Nothing under /etc is used
except two lines this module adds to /etc/hosts (once, idempotently) so that the node names resolve:

    127.0.0.1 n1
    127.0.0.2 n2

Clients (sbatch, squeue, scontrol, srun inside jobs) find the cluster through SLURM_CONF in `env`.
`stop()` cancels every job, then stops each daemon this module started, by its pid, and any process still
running under this cluster's slurm.conf (the job steps), also by pid.

By hand:  python tests/slurm_cluster.py   (starts the cluster, prints how to use it; Ctrl-C or SIGTERM stops it)
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from helpers import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "sinfo", "scancel")
NODES = {"n1": "127.0.0.1", "n2": "127.0.0.2"}
HOSTS_FILE = Path("/etc/hosts")
HOSTS_TAG = "# mixprec test SLURM cluster (tests/slurm_cluster.py)"
# A requeued job may only start again after the job credential expires: 120 s by default, 10 s here.
CRED_EXPIRE_S = 10


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def first_job_id(template_port, jobs: int = 40) -> int:
    """A random first job id whose next `jobs` ids all map (through the template's own rule,
    `template_port(job_id)`) to ports that are free now: the template's port-from-job-id is what the
    tests exercise, without colliding with other tests running on this machine."""
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(1000, 900_000)
        if all(_port_is_free(template_port(first + i)) for i in range(jobs)):
            return first
    raise RuntimeError("no free range of ports for the SLURM test jobs")


def ensure_hosts_entries() -> None:
    """Make n1 and n2 resolve (scontrol show hostnames gives node names). Adds only what is missing."""
    text = HOSTS_FILE.read_text()
    have = {}
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        for name in fields[1:]:
            have.setdefault(name, fields[0])
    missing = [f"{addr} {name}" for name, addr in NODES.items() if name not in have]
    wrong = [name for name, addr in NODES.items() if name in have and have[name] != addr]
    if wrong:
        raise RuntimeError(f"{HOSTS_FILE} maps {wrong[0]} to {have[wrong[0]]}, not {NODES[wrong[0]]}: "
                           f"the test cluster needs that name; remove the line")
    if missing:
        with open(HOSTS_FILE, "a") as f:
            f.write(("" if text.endswith("\n") else "\n") + HOSTS_TAG + "\n" + "\n".join(missing) + "\n")


class SlurmCluster:
    def __init__(self, template_port=None):
        self.root = Path(tempfile.mkdtemp(prefix="mixprec-slurm-"))
        self.root.chmod(0o755)  # munged wants every folder above its socket searchable by all
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.template_port = template_port

    # -- start and stop ------------------------------------------------------------------------------
    def start(self, timeout: float = 60) -> "SlurmCluster":
        ensure_hosts_entries()
        try:
            self._start_munged()
            self._write_conf()
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            self._wait(lambda: self._ok(["scontrol", "ping"]), timeout, "slurmctld to answer")
            for node in NODES:
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-f", str(self.conf), "-N", node])
            self._wait(self._nodes_idle, timeout, "both nodes to be idle in sinfo")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munged(self) -> None:
        mdir = self.root / "munge"
        mdir.mkdir(mode=0o755)
        key = mdir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.munge_socket = mdir / "munge.socket"
        self._spawn("munged", ["munged", "-F", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                               f"--pid-file={mdir / 'munged.pid'}", f"--log-file={mdir / 'munged.log'}",
                               f"--seed-file={mdir / 'munged.seed'}"])
        self._wait(self.munge_socket.exists, 20, "munged to open its socket")

    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        first = first_job_id(self.template_port) if self.template_port else random.randrange(1000, 900_000)
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir()
        r = self.root
        # CPUs=8 per node: the template's --cpus-per-task. The machine may have fewer cores; config_overrides
        # (below) keeps slurmd from draining a node that declares more than it has.
        node_lines = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr={addr} Port={free_port()} CPUs=8 "
                               f"RealMemory=4000 State=UNKNOWN" for n, addr in NODES.items())
        self.conf.write_text(f"""\
ClusterName=mixprectest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SlurmdParameters=config_overrides
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
FirstJobId={first}
MinJobAge=600
KillWait=30
InactiveLimit=0
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
{node_lines}
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / f"{name}.stdout", "w")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        log.close()

    def stop(self) -> None:
        """Cancel every job, stop the daemons (by pid), then any process left under this slurm.conf."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            active = self.job_ids(states="PD,R,CF,CG,S,RQ,RF,RH,RS,SO,ST")
            if active:
                subprocess.run(["scancel", "--full", "--quiet", *active], env=self.env, capture_output=True)
            deadline = time.monotonic() + 40  # KillWait (30 s) and a margin
            while self.job_ids(states="R,CF,CG,RQ") and time.monotonic() < deadline:
                time.sleep(0.5)
        for name in [*(n for n in self.procs if n.startswith("slurmd")), "slurmctld", "munged"]:
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in self.leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def leftover_pids(self) -> list[int]:
        """This cluster's slurmstepd and job processes: their environment names this cluster's slurm.conf,
        and they are a slurmstepd or have a SLURM_JOB_ID (a shell that merely exported SLURM_CONF is spared)."""
        needle = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
                stepd = (entry / "cmdline").read_bytes().startswith(b"slurmstepd")
            except OSError:
                continue
            if needle in environ and (stepd or any(v.startswith(b"SLURM_JOB_ID=") for v in environ)):
                pids.append(int(entry.name))
        return pids

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # -- queries -------------------------------------------------------------------------------------
    def _ok(self, cmd: list[str]) -> bool:
        return subprocess.run(cmd, env=self.env, capture_output=True).returncode == 0

    def _nodes_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in NODES)

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}) while waiting for {what}:\n"
                                       f"{self.logs()}")
            if ready():
                return
            time.sleep(0.3)
        raise RuntimeError(f"timed out waiting for {what}:\n{self.logs()}")

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for path in sorted([*self.root.glob("*.stdout"), *self.root.glob("log/*.log")]):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def job_ids(self, states: str) -> list[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i", "-t", states], env=self.env, capture_output=True,
                             text=True)
        return out.stdout.split()

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, RestartCnt, ExitCode, NodeList, ...)."""
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=self.env, capture_output=True,
                             text=True)
        info = {}
        for item in out.stdout.split():
            key, sep, value = item.partition("=")
            if sep:
                info[key] = value
        return info


if __name__ == "__main__":
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    cluster = SlurmCluster().start()
    print(f"cluster up: export SLURM_CONF={cluster.conf}   (Ctrl-C stops it)", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
        cluster.cleanup()
