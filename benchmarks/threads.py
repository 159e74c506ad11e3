#!/usr/bin/env python
"""CPU threads: a small model's step time with each thread setting, on an idle machine and beside busy processes.

    python benchmarks/threads.py                         # the MLP, idle and beside 1 busy process: 24 runs
    python benchmarks/threads.py --max_steps 50 --repeats 1 --output_dir runs/threads-quick
    python benchmarks/threads.py --models mlp,gpt_tiny,bert --conditions busy-1,busy-3,busy-6 \
        --settings 1,default --repeats 2 --output_dir runs/threads-busy      # the busy-machine table

The job is the recipe (`python recipes/train.py`, no tracker) on each of --models: `mlp`, the default job (the
lesson's MLP on synthetic data, --max_steps steps logged every --log_every); `gpt_tiny`
(recipes/configs/gpt_tiny.yaml) and `bert` (a tiny BERT classifier, recipes/configs/hf_bert_classifier.yaml at
batch 32, on the model and CSV that scripts/make_tiny_hf.py makes, built into DIR/tiny_bert first), each for
--hf_steps steps logged every --hf_log_every. Thread settings (N = usable cores):
- 1: `--cpu_threads 1`;
- N: `--cpu_threads N`;
- N+passive: `--cpu_threads N` with OMP_WAIT_POLICY=PASSIVE in the run's environment (OpenMP threads sleep
  instead of spinning while they wait; it must be set before torch loads, hence the environment);
- default: no flag and no OpenMP variable: whatever the recipe does by itself (its choice, read from its
  banner, is reported).
OMP_NUM_THREADS and OMP_WAIT_POLICY of this shell are removed from every run's environment; the settings 1 and
N run with OMP_WAIT_POLICY=ACTIVE (threads spin while they wait; GNU OpenMP unset spins a short time, then
sleeps; the recipe's default is PASSIVE unless one is set).
Conditions: idle (nothing else of ours runs), busy-K (K competing processes of ours: Python busy loops, started
before the run and killed after it, each with its own hard time limit; `busy` is busy-1), train-K (K small torch
training loops instead, each on torch's own thread count and OpenMP's own waiting, as most other PyTorch jobs run:
many-threaded, many short parallel regions a step). Where the recipe's
default chooses 1 thread its runs are the 1-thread setting's configuration (the wait policy aside, which does not
apply to one thread), and the table says so: the two rows then differ only by the machine's noise.
Runs are interleaved and repeated: each repeat runs every model x condition x setting once, in a rotated order.
A run's step time is the median of its windows after the first --skip_windows (start-up, first epoch's set-up);
a row's is the median over its runs, with their spread ((slowest - fastest) / median) and its ratio to the best
setting of the same model and condition (1.00 = the best). A run that passes --run_timeout is stopped and
counted at its timeout (a lower bound, marked). The whole command's wall time (start-up, evaluation and end
included) is shown beside: a setting that slows the start-up shows there, not in the step time. The share of the CPUs used by other processes (not ours) during
each run is reported: a machine that was not idle makes the idle rows meaningless.

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
MODELS = ("mlp", "gpt_tiny", "bert")
BUSY_LOOP = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"
# another small training job as most PyTorch programs run: torch's own thread count (every core), OpenMP's own
# waiting (threads spin a short time, then sleep), many short parallel regions a step: forward, backward and an
# update of a 256-wide layer
TRAIN_LOOP = """import sys, time
import torch
x, w = torch.randn(64, 256), torch.randn(256, 256, requires_grad=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    (x @ w).relu().sum().backward()
    with torch.no_grad():
        w -= 1e-6 * w.grad
    w.grad = None
"""
KINDS = {"busy": "busy", "train": "training"}  # condition prefix -> what the competing processes are


def _condition(text: str) -> str:
    if text in KINDS:
        return f"{text}-1"
    kind, _, count = text.partition("-")
    if text == "idle" or (kind in KINDS and count.isdigit() and int(count) >= 1):
        return text
    raise UsageError(f"--conditions: {text!r} is not idle, busy-K (K busy loops) or train-K (K small training "
                     f"processes), K >= 1")


def busy_count(condition: str) -> int:
    return 0 if condition == "idle" else int(condition.partition("-")[2])


def busy_kind(condition: str) -> str:
    return condition.partition("-")[0]


def describe(condition: str) -> str:
    k = busy_count(condition)
    return "idle" if not k else f"{k} {KINDS[busy_kind(condition)]} process{'es' if k > 1 else ''}"


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp", help=f"comma-separated: {', '.join(MODELS)} (default: mlp)")
    parser.add_argument("--max_steps", type=int, default=300, help="steps of each mlp run (default: 300)")
    parser.add_argument("--log_every", type=int, default=25, help="mlp steps per timing window (default: 25)")
    parser.add_argument("--hf_steps", type=int, default=40, help="steps of each gpt_tiny and bert run (default: 40)")
    parser.add_argument("--hf_log_every", type=int, default=5, help="their steps per window (default: 5)")
    parser.add_argument("--skip_windows", type=int, default=1, help="first windows not counted (default: 1)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each condition x setting (default: 3)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated: {', '.join(SETTINGS)}")
    parser.add_argument("--conditions", default="idle,busy", help="comma-separated: idle, busy, busy-K, train-K")
    parser.add_argument("--run_timeout", type=int, default=900, help="seconds before a run is stopped (default: 900)")
    parser.add_argument("--output_dir", default=None, help="default: runs/threads-<date>-<time>")
    parser.error = lambda message: (_ for _ in ()).throw(UsageError(f"{message} (see --help)"))
    args = parser.parse_args(argv)
    for name, allowed in (("settings", SETTINGS), ("models", MODELS)):
        items = [x.strip() for x in getattr(args, name).split(",") if x.strip()]
        bad = [x for x in items if x not in allowed] or ([] if items else ["(empty)"])
        if bad:
            raise UsageError(f"--{name}: {bad[0]!r} is not one of {', '.join(allowed)}")
        setattr(args, name, list(dict.fromkeys(items)))
    args.conditions = list(dict.fromkeys(_condition(x.strip()) for x in args.conditions.split(",") if x.strip()))
    if not args.conditions:
        raise UsageError("--conditions is empty: give idle, busy, busy-K or train-K")
    for name in ("max_steps", "log_every", "hf_steps", "hf_log_every", "repeats", "run_timeout"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} {getattr(args, name)} must be positive")
    for steps, every in (("max_steps", "log_every"), ("hf_steps", "hf_log_every")):
        if args.skip_windows < 0 or getattr(args, steps) // getattr(args, every) <= args.skip_windows:
            raise UsageError(f"--{steps} {getattr(args, steps)} / --{every} {getattr(args, every)} leaves no window "
                             f"after --skip_windows {args.skip_windows}: run more steps or skip fewer windows")
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


def model_args(model: str, args) -> list[str]:
    """The recipe's flags for `model` (bert: its model and CSV, made into DIR/tiny_bert once)."""
    if model == "mlp":
        return ["--max_steps", str(args.max_steps), "--log_every", str(args.log_every)]
    steps = ["--max_steps", str(args.hf_steps), "--log_every", str(args.hf_log_every), "--eval_steps",
             str(args.hf_steps)]
    if model == "gpt_tiny":
        return ["--config", "recipes/configs/gpt_tiny.yaml", *steps]
    folder = (args.output_dir / "tiny_bert").resolve()
    if not (folder / "classify.csv").is_file():
        subprocess.run([sys.executable, "scripts/make_tiny_hf.py", str(folder), "--arch", "bert"], cwd=REPO,
                       check=True, capture_output=True)
    return ["--config", "recipes/configs/hf_bert_classifier.yaml", "--model_name_or_path", str(folder / "model"),
            "--train_file", str(folder / "classify.csv"), "--batch_size", "32", *steps]


def launch(setting: str, model: str, args, out: Path) -> tuple[list[str], dict]:
    """The command and environment of one run of `setting`."""
    env = {k: v for k, v in os.environ.items() if k not in REMOVED}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "recipes/train.py", *model_args(model, args), "--report_to", "none",
           "--output_dir", str(out), "--overwrite_output_dir"]
    if setting != "default":
        cmd += ["--cpu_threads", "1" if setting == "1" else str(usable_cores())]
    if setting in ("1", "N"):
        env["OMP_WAIT_POLICY"] = "ACTIVE"  # spinning (the recipe's is PASSIVE unless one is set)
    elif setting == "N+passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return cmd, env


def start_busy(seconds: float, kind: str = "busy") -> subprocess.Popen:
    """One competing process until killed or `seconds` have passed: a loop spinning on one core (busy), or a
    small training loop on torch's threads (train)."""
    env = {k: v for k, v in os.environ.items() if k not in REMOVED}  # train: OpenMP's own waiting (spin, then sleep)
    return subprocess.Popen([sys.executable, "-c", TRAIN_LOOP if kind == "train" else BUSY_LOOP, str(seconds)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def run(setting: str, condition: str, model: str, repeat: int, args) -> dict:
    name = f"{model}-{condition}-{setting.replace('+', '-')}-{repeat}"
    out = args.output_dir / "runs" / name
    out.mkdir(parents=True, exist_ok=True)
    cmd, env = launch(setting, model, args, out)
    shown = " ".join([*([f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']}"] if "OMP_WAIT_POLICY" in env else []), "python",
                      *map(shlex.quote, cmd[1:])])
    print(f"[{name}] {shown}", flush=True)
    busy = [start_busy(args.run_timeout + 30, busy_kind(condition)) for _ in range(busy_count(condition))]
    time.sleep((2.0 if busy_kind(condition) == "train" else 0.3) if busy else 0)  # at work before the run starts
    meter = bm.LoadMeter()
    timed_out = False
    try:
        with open(out / "run.log", "w") as log:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        ended = [b.poll() for b in busy]  # a competitor that ended early would leave the run less busy than named
        for b in busy:
            b.kill()
            b.wait()
    if any(code is not None for code in ended):
        raise SystemExit(f"error: a competing {KINDS[busy_kind(condition)]} process of {name} ended early (exit "
                         f"{next(c for c in ended if c is not None)}): the run was not as busy as its condition says")
    load = meter.stop()  # its wall_s: the run's whole command
    text = (out / "run.log").read_text()
    threads = re.search(r"\((\d+) threads? per process\)", text)
    result = {"model": model, "setting": setting, "condition": condition, "repeat": repeat,
              "threads": int(threads.group(1)) if threads else None, "command": shown, "competitors": busy_kind(condition) if busy else None, **load}
    steps = args.max_steps if model == "mlp" else args.hf_steps
    if timed_out:  # counted at its timeout: the step time is at least this
        return {**result, "step_time_median_s": args.run_timeout / steps, "timed_out": True}
    if proc.returncode:
        raise SystemExit(f"error: {name} exited {proc.returncode}; see {out / 'run.log'}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [r["step_time_s"] for r in records if "step_time_s" in r and "loss" in r][args.skip_windows:]
    return {**result, "step_time_median_s": statistics.median(windows)}


def rows(runs: list[dict]) -> list[dict]:
    out = []
    keys = list(dict.fromkeys((r["model"], r["condition"]) for r in runs))
    for model, condition in sorted(keys, key=lambda k: (MODELS.index(k[0]), k[1] != "idle", busy_kind(k[1]), busy_count(k[1]))):
        for setting in SETTINGS:
            mine = [r for r in runs if (r["model"], r["condition"], r["setting"]) == (model, condition, setting)]
            if mine:
                times = [r["step_time_median_s"] for r in mine]
                median = statistics.median(times)
                out.append({"model": model, "condition": condition, "setting": setting, "threads":
                            sorted({r["threads"] for r in mine if r["threads"]}), "runs": len(times),
                            "step_time_median_s": median, "spread": (max(times) - min(times)) / median,
                            "wall_median_s": statistics.median(r["wall_s"] for r in mine),
                            "timed_out": sum(bool(r.get("timed_out")) for r in mine)})
    for row in out:
        best = min(r["step_time_median_s"] for r in out if (r["model"], r["condition"]) == (row["model"],
                                                                                         row["condition"]))
        row["ratio_to_best"] = row["step_time_median_s"] / best
    return out


def markdown(report: dict) -> str:
    names = {"1": "1 thread", "N": f"{report['cores']} threads", "default": "the recipe's default",
             "N+passive": f"{report['cores']} threads + OMP_WAIT_POLICY=PASSIVE"}
    state = "" if report["complete"] else f" (INCOMPLETE: {len(report['runs'])} of {report['planned_runs']} runs)"
    lines = [f"**Thread settings, median of {report['repeats']} interleaved runs{state}; {report['hardware']}**", "",
             "| model | machine | threads | step time (median) | spread | vs the best | whole command (median) |",
             "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        count = "/".join(map(str, r["threads"]))
        who = names[r["setting"]] + (f" ({count})" if r["setting"] == "default" else "")
        machine = describe(r["condition"])
        if r["setting"] == "default" and r["threads"] == [1] and "1" in report["settings"]:
            who += ": the 1-thread run's configuration"
        late = f", {r['timed_out']} stopped at the timeout" if r["timed_out"] else ""
        lines.append(f"| {r['model']} | {machine} | {who} | {r['step_time_median_s'] * 1e3:,.2f} ms "
                     f"| {r['spread']:.1%} of {r['runs']}{late} | {r['ratio_to_best']:.2f}x "
                     f"| {r['wall_median_s']:.1f} s |")
    lines += ["", f"Machine: {bm.describe_machine(report['machine'], report['runs'], threads=False)}.", "", "Command:", "",
              f"    {report['command']}"]
    return "\n".join(lines) + "\n"


@exit_on_usage_error
def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    plan = [(c, s, m) for m in args.models for c in args.conditions for s in args.settings]
    report = {"models": args.models, "settings": args.settings, "max_steps": args.max_steps, "log_every": args.log_every,
              "hf_steps": args.hf_steps, "hf_log_every": args.hf_log_every, "repeats": args.repeats,
              "cores": usable_cores(), "hardware": machine_line(), "machine": machine(), "complete": False,
              "planned_runs": len(plan) * args.repeats, "runs": [], "rows": [],
              "command": f"python benchmarks/threads.py {' '.join(map(shlex.quote, argv))}".strip()}
    for repeat in range(1, args.repeats + 1):
        shift = (repeat - 1) % len(plan)
        for condition, setting, model in plan[shift:] + plan[:shift]:  # rotated: no setting always runs first
            report["runs"].append(run(setting, condition, model, repeat, args))
            report["machine"]["loadavg_after"] = report["runs"][-1].get("loadavg_after")
            report["rows"] = rows(report["runs"])
            report["complete"] = len(report["runs"]) == report["planned_runs"]
            (args.output_dir / "threads.json").write_text(json.dumps(report, indent=2) + "\n")
            (args.output_dir / "threads.md").write_text(markdown(report))
    print("\n" + markdown(report) + f"\nwrote {args.output_dir}/threads.json, threads.md")
    return report


if __name__ == "__main__":
    main()
