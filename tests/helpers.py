"""Shared test helpers: run a recipe for real (a subprocess through `accelerate launch` or python, or its
`main` in this process) and read what it wrote."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mixprec.metrics import TIMING_FIELDS

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "recipes" / "train.py"
CONFIGS = REPO / "accelerate_configs"
CPU_CONFIG = CONFIGS / "cpu.yaml"
HOOKS = Path(__file__).resolve().parent / "hooks"
# `accelerate launch` without its console script: the same parser and `launch_command`, without the import of
# every other subcommand that the console script does first (about 2 s a launch on 2 cores: transformers,
# through `accelerate estimate-memory`). Tests of the console script itself (README's commands as written,
# signals to the launcher, the canaries) run `accelerate launch`.
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    out: Path | None

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines() if line]

    def comparable(self) -> list[dict]:
        """metrics.jsonl without the fields that measure time or memory, which differ between any two runs."""
        return without_timings(self.metrics())

    def train_records(self) -> list[dict]:
        return [r for r in self.metrics() if "loss" in r]

    def eval_records(self) -> list[dict]:
        return [r for r in self.metrics() if "val_loss" in r]

    def events(self) -> list[dict]:
        return [r for r in self.metrics() if "event" in r]

    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    def config(self) -> dict:
        import yaml
        return yaml.safe_load((self.out / "config.yaml").read_text())


def without_timings(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in records]


def base_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "MIXPREC_"))}
    env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra or {})
    return env


def hooks_env(faults: str | None = None, audit: tuple[Path, Path] | None = None, release: Path | None = None,
              teardown: Path | None = None) -> dict:
    """Environment that puts tests/hooks/sitecustomize.py into the recipe's processes: `faults` (see
    tests/faults.py), `audit` = (root watched, folder for the logs), `release` for pause_at_step, `teardown` a
    folder for the teardown log (`teardown_order`)."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HOOKS), os.environ.get("PYTHONPATH")]))}
    if faults:
        env["MIXPREC_TEST_FAULTS"] = faults
    if audit:
        env["MIXPREC_AUDIT_ROOT"], env["MIXPREC_AUDIT_DIR"] = str(audit[0]), str(audit[1])
    if release:
        env["MIXPREC_TEST_RELEASE"] = str(release)
    if teardown:
        env["MIXPREC_TEST_TEARDOWN_DIR"] = str(teardown)
    return env


def _stat(pid) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, parent pid, ..."""
    return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def live_processes(parent: int | None = None):
    """(pid, command line with NUL separators, environment entries) of each live process this user can read
    (zombies left out); with `parent`, only that process's children."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            environ = (entry / "environ").read_bytes().split(b"\0")
            state, ppid = _stat(entry.name)[:2]
        except OSError:
            continue
        if state != "Z" and (parent is None or int(ppid) == parent):
            yield int(entry.name), cmdline, environ


def free_port() -> int:
    """A TCP port nobody listens on now: multi-process runs must not share a fixed one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_recipe(*args, out: Path | None = None, launcher: str = "accelerate", script: Path = TRAIN,
               env: dict | None = None, cwd: Path | None = None, timeout: int = 480, check: bool = True,
               config: Path = CPU_CONFIG, launch_args: tuple = (), faults: str | None = None) -> Run:
    """Run a recipe in a subprocess. `launcher`: 'accelerate' (Accelerate's launcher with `config`, the CPU
    config by default, and `launch_args`: see ACCELERATE_LAUNCH) or 'python'. `faults`: see tests/faults.py.
    With `check`, a non-zero exit fails the test and shows the output. After `timeout` seconds (480 by default:
    under pytest's 600 s, so that this answers first) the test fails with the stacks of the launcher and of every
    process under it (`stacks`), and all of them are killed, as they are when the test is interrupted."""
    cmd = ([*ACCELERATE_LAUNCH, "--config_file", str(config), *map(str, launch_args)] if launcher == "accelerate"
           else [sys.executable])
    cmd += [str(script), *map(str, args)]
    if out is not None:
        cmd += ["--output_dir", str(out)]
    env = {**(hooks_env(faults) if faults else {}), **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base_env(env),
                            cwd=cwd or REPO)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = descendants(proc.pid)  # before any is killed: an orphan no longer shows whose it was
        dumps = stacks(tree)
        kill(tree)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", "(not read: a process outside the tree still holds the output)"
        pytest.fail(f"{' '.join(cmd)} did not end in {timeout} s; the stacks of its processes:\n{dumps}\n"
                    f"STDOUT:\n{stdout[-4000:]}\nSTDERR:\n{stderr[-4000:]}", pytrace=False)
    finally:
        if proc.poll() is None:  # the test was interrupted (pytest's timeout, Ctrl-C): nothing left behind
            kill(descendants(proc.pid))
            proc.wait()
    run = Run(proc.returncode, stdout, stderr, out)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\nSTDOUT:\n{stdout[-4000:]}\n"
                    f"STDERR:\n{stderr[-4000:]}")
    return run


def descendants(pid: int) -> list[int]:
    """`pid` and every live process started under it, however far down, parents first (found by parent pid: the
    workers that torchrun starts run in sessions and process groups of their own)."""
    found = [pid]
    for parent in found:
        found += [child for child, _, _ in live_processes(parent)]
    return found


def kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stacks(pids: list[int]) -> str:
    """Each of these processes still alive: its threads' Python and native stacks from py-spy (a test dependency),
    or where py-spy is missing or cannot attach, each thread's name and the kernel function it waits in."""
    lines, spy = [], shutil.which("py-spy")
    for pid in pids:
        entry = Path("/proc") / str(pid)
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        lines.append(f"== process {pid}: {command[:300]}")
        try:
            dump = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                                  timeout=60) if spy else None
        except subprocess.TimeoutExpired:
            dump = None
        if dump is not None and dump.returncode == 0:
            lines.append(dump.stdout)
            continue
        for task in sorted((entry / "task").glob("*")):
            try:
                lines.append(f"  thread {task.name} {(task / 'comm').read_text().strip()}: waits in "
                             f"{(task / 'wchan').read_text().strip() or '(running)'}")
            except OSError:
                pass
    return "\n".join(lines) or "(no process left)"


def teardown_env(folder: Path, pythonpath: str | None = None) -> dict:
    """The environment of a multi-process run whose teardown tests/hooks/sitecustomize.py logs into `folder`
    (made here; read it with `teardown_order`), with `pythonpath` after the hooks' folder."""
    folder.mkdir()
    env = hooks_env(teardown=folder)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(HOOKS), pythonpath])
    return env


def teardown_order(folder: Path, world: int = 2, freed_first: bool = False) -> list[dict]:
    """What tests/hooks/sitecustomize.py logged (`teardown_env`): each rank's process-group destroys and the
    DistributedDataParallel wrappers freed. Asserts that each of the `world` ranks destroyed its group and that
    no wrapper was freed after it (mixprec/compat/teardown.py: a Reducer that outlives its group can hang the
    process); with `freed_first`, that no wrapper was alive any more when the group was destroyed (the
    standalone recipes: not even one left for the interpreter's teardown, which the log cannot see)."""
    records = [json.loads(line) for log in sorted(folder.glob("rank-*.jsonl")) for line in log.read_text().splitlines()]
    destroys = [r for r in records if r["event"] == "destroy"]
    assert {r["rank"] for r in destroys} == set(range(world)), records
    assert not [r for r in records if r["event"] == "ddp_freed" and r["after_destroy"]], records
    if freed_first:
        assert all(r["live_ddp"] == 0 for r in destroys), records
    return records


def reset_accelerate() -> None:
    """Accelerate keeps process-wide singletons: forget them, as a new process would."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def main_in_process(args) -> dict:
    """`recipes/train.py`'s main in this process, with Accelerate's state reset as a fresh process has it."""
    from importlib import import_module

    import matplotlib.figure  # noqa: F401  imported once here: the run draws metrics.png itself, as a process that
    # has matplotlib imported does (mixprec.tracking.plot_process), instead of a new helper importing it again
    reset_accelerate()
    sys.path.insert(0, str(REPO / "recipes"))
    try:
        train = import_module("train")
    finally:
        sys.path.remove(str(REPO / "recipes"))
    return train.main([str(a) for a in args])


def run_in_process(args, capsys) -> Run:
    """`recipes/train.py`'s main in this process (its exit code: 0 when it returns), as a fresh process would
    run it."""
    try:
        main_in_process(args)
        code = 0
    except SystemExit as exited:
        code = exited.code
    out, err = capsys.readouterr()
    return Run(code, out, err, None)


def snapshot(root: Path) -> dict[str, str]:
    """Path -> sha256 of every file under root: equal snapshots mean nothing was touched."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def assert_one_line_error(run: Run, *words: str, code: int = 2) -> str:
    """Bad input: exit code 2, no traceback, one line on stderr naming each of `words`. Returns the line."""
    assert run.returncode == code, (run.returncode, run.stderr[-2000:])
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in run.stderr + run.stdout
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]
