#!/usr/bin/env python
"""CPU threads: the default job's step time with each thread setting, on an idle machine and beside one busy
process.

    python benchmarks/threads.py                         # 300 steps, 3 repeats: 24 runs, 5-7 minutes on a 2-core AMD EPYC
    python benchmarks/threads.py --max_steps 50 --repeats 1 --output_dir runs/threads-quick

The job is the recipe's default (`python recipes/train.py`: the lesson's MLP on synthetic data) for
--max_steps steps, logged every --log_every steps, with no tracker. Thread settings (N = usable cores):
- 1: `--cpu_threads 1`;
- N: `--cpu_threads N`;
- N+passive: `--cpu_threads N` with OMP_WAIT_POLICY=PASSIVE in the run's environment (OpenMP threads sleep
  instead of spinning while they wait; it must be set before torch loads, hence the environment);
- default: no flag and no OpenMP variable: whatever the recipe does by itself (its choice, read from its
  banner, is reported).
OMP_NUM_THREADS and OMP_WAIT_POLICY of this shell are removed from every run's environment; the settings 1 and N
run with OMP_WAIT_POLICY=ACTIVE, OpenMP's own default (the recipe's default is PASSIVE unless one is set).
Conditions: idle (nothing else of ours runs), busy (one competing process of ours: a Python busy loop on one
core, started before the run and killed after it, with its own hard time limit).
Runs are interleaved and repeated: each repeat runs every condition x setting once, in a rotated order. A run's
step time is the median of its windows after the first --skip_windows (start-up, first epoch's set-up); a
row's is the median over its runs, with their spread ((slowest - fastest) / median) and its ratio to the best
setting of the same condition (1.00 = the best). The share of the CPUs used by other processes (not ours)
during each run is reported: a machine that was not idle makes the idle rows meaningless.

Writes DIR/threads.json and DIR/threads.md after every run (default DIR: runs/threads-<date>-<time>);
each run's folder and log are under DIR/runs/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mixprec import benchmarking as bm
from mixprec.errors import UsageError, exit_on_usage_error
from mixprec.devices.hardware import machine_line, usable_cores

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ("1", "N", "N+passive", "default")
CONDITIONS = ("idle", "busy")
BUSY_LOOP = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_steps", type=int, default=300, help="steps of each run (default: 300)")
    parser.add_argument("--log_every", type=int, default=25, help="steps per timing window (default: 25)")
    parser.add_argument("--skip_windows", type=int, default=1, help="first windows not counted (default: 1)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each condition x setting (default: 3)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated: {', '.join(SETTINGS)}")
    parser.add_argument("--conditions", default=",".join(CONDITIONS), help="comma-separated: idle, busy")
    parser.add_argument("--run_timeout", type=int, default=900, help="seconds before a run is stopped (default: 900)")
    parser.add_argument("--output_dir", default=None, help="default: runs/threads-<date>-<time>")
    parser.error = lambda message: (_ for _ in ()).throw(UsageError(f"{message} (see --help)"))
    args = parser.parse_args(argv)
    for name, allowed in (("settings", SETTINGS), ("conditions", CONDITIONS)):
        items = [x.strip() for x in getattr(args, name).split(",") if x.strip()]
        bad = [x for x in items if x not in allowed] or ([] if items else ["(empty)"])
        if bad:
            raise UsageError(f"--{name}: {bad[0]!r} is not one of {', '.join(allowed)}")
        setattr(args, name, list(dict.fromkeys(items)))
    for name in ("max_steps", "log_every", "repeats", "run_timeout"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} {getattr(args, name)} must be positive")
    if args.skip_windows < 0 or args.max_steps // args.log_every <= args.skip_windows:
        raise UsageError(f"--max_steps {args.max_steps} / --log_every {args.log_every} leaves no window after "
                         f"--skip_windows {args.skip_windows}: run more steps or skip fewer windows")
    args.output_dir = Path(args.output_dir or f"runs/threads-{time.strftime('%Y%m%d-%H%M%S')}")
    if (args.output_dir / "threads.json").exists():
        raise UsageError(f"--output_dir {args.output_dir} holds a threads benchmark already: give a new folder")
    return args


REMOVED = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")  # this shell's, removed from every run: each setting sets its own


def machine() -> dict:
    """The machine as the runs see it: without the thread variables they do not inherit, nor this process's own
    torch thread count (which the shell's OMP_NUM_THREADS sets; each run's threads are in its row)."""
    m = bm.machine()
    m["thread_env"] = {k: v for k, v in m["thread_env"].items() if k not in REMOVED}
    m.pop("torch_threads", None)
    return m


def launch(setting: str, args, out: Path) -> tuple[list[str], dict]:
    """The command and environment of one run of `setting`."""
    env = {k: v for k, v in os.environ.items() if k not in REMOVED}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "recipes/train.py", "--max_steps", str(args.max_steps), "--log_every", str(args.log_every),
           "--report_to", "none", "--output_dir", str(out), "--overwrite_output_dir"]
    if setting != "default":
        cmd += ["--cpu_threads", "1" if setting == "1" else str(usable_cores())]
    if setting in ("1", "N"):
        env["OMP_WAIT_POLICY"] = "ACTIVE"  # OpenMP's own default (the recipe's is PASSIVE unless one is set)
    elif setting == "N+passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return cmd, env


def start_busy(seconds: float) -> subprocess.Popen:
    """One process spinning on one core until killed or `seconds` have passed."""
    return subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(seconds)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def run(setting: str, condition: str, repeat: int, args) -> dict:
    name = f"{condition}-{setting.replace('+', '-')}-{repeat}"
    out = args.output_dir / "runs" / name
    out.mkdir(parents=True, exist_ok=True)
    cmd, env = launch(setting, args, out)
    shown = " ".join([*([f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}"] if "OMP_WAIT_POLICY" in env else []), "python",
                      *map(shlex.quote, cmd[1:])])
    print(f"[{name}] {shown}", flush=True)
    busy = start_busy(args.run_timeout + 30) if condition == "busy" else None
    meter = bm.LoadMeter()
    try:
        with open(out / "run.log", "w") as log:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"error: {name} ran past --run_timeout {args.run_timeout} s; see {out / 'run.log'}") from None
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    load = meter.stop()
    text = (out / "run.log").read_text()
    if proc.returncode:
        raise SystemExit(f"error: {name} exited {proc.returncode}; see {out / 'run.log'}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [r["step_time_s"] for r in records if "step_time_s" in r and "loss" in r][args.skip_windows:]
    threads = re.search(r"\((\d+) threads? per process\)", text)
    return {"setting": setting, "condition": condition, "repeat": repeat,
            "step_time_median_s": statistics.median(windows),
            "threads": int(threads.group(1)) if threads else None, "command": shown, **load}


def rows(runs: list[dict]) -> list[dict]:
    out = []
    for condition in CONDITIONS:
        for setting in SETTINGS:
            times = [r["step_time_median_s"] for r in runs if (r["condition"], r["setting"]) == (condition, setting)]
            if times:
                threads = next(r["threads"] for r in runs if (r["condition"], r["setting"]) == (condition, setting))
                median = statistics.median(times)
                out.append({"condition": condition, "setting": setting, "threads": threads, "runs": len(times),
                            "step_time_median_s": median, "spread": (max(times) - min(times)) / median})
    for row in out:
        best = min(r["step_time_median_s"] for r in out if r["condition"] == row["condition"])
        row["ratio_to_best"] = row["step_time_median_s"] / best
    return out


def markdown(report: dict) -> str:
    names = {"1": "1 thread", "N": f"{report['cores']} threads", "default": "the recipe's default",
             "N+passive": f"{report['cores']} threads + OMP_WAIT_POLICY=PASSIVE"}
    state = "" if report["complete"] else f" (INCOMPLETE: {len(report['runs'])} of {report['planned_runs']} runs)"
    lines = [f"**Thread settings, the default job ({report['max_steps']} steps), median of {report['repeats']} "
             f"interleaved runs{state}; {report['hardware']}**", "",
             "| machine | threads | step time (median) | spread | vs the best |", "|---|---|---|---|---|"]
    for r in report["rows"]:
        who = names[r["setting"]] + (f" ({r['threads']})" if r["setting"] == "default" else "")
        lines.append(f"| {'idle' if r['condition'] == 'idle' else 'one busy process'} | {who} "
                     f"| {r['step_time_median_s'] * 1e3:,.2f} ms | {r['spread']:.1%} of {r['runs']} "
                     f"| {r['ratio_to_best']:.2f}x |")
    lines += ["", f"Machine: {bm.describe_machine(report['machine'], report['runs'], threads=False)}.", "", "Command:", "",
              f"    {report['command']}"]
    return "\n".join(lines) + "\n"


@exit_on_usage_error
def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    plan = [(c, s) for c in args.conditions for s in args.settings]
    report = {"max_steps": args.max_steps, "log_every": args.log_every, "repeats": args.repeats,
              "cores": usable_cores(), "hardware": machine_line(), "machine": machine(), "complete": False,
              "planned_runs": len(plan) * args.repeats, "runs": [], "rows": [],
              "command": f"python benchmarks/threads.py {' '.join(map(shlex.quote, argv))}".strip()}
    for repeat in range(1, args.repeats + 1):
        shift = (repeat - 1) % len(plan)
        for condition, setting in plan[shift:] + plan[:shift]:  # rotated: no setting always runs first
            report["runs"].append(run(setting, condition, repeat, args))
            report["machine"]["loadavg_after"] = report["runs"][-1].get("loadavg_after")
            report["rows"] = rows(report["runs"])
            report["complete"] = len(report["runs"]) == report["planned_runs"]
            (args.output_dir / "threads.json").write_text(json.dumps(report, indent=2) + "\n")
            (args.output_dir / "threads.md").write_text(markdown(report))
    print("\n" + markdown(report) + f"\nwrote {args.output_dir}/threads.json, threads.md")
    return report


if __name__ == "__main__":
    main()
