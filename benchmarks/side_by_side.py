#!/usr/bin/env python
"""The recipe and a transformers peer at the same time, one thread each, each pinned to a core of its own: both
meet the same spells of a noisy machine at the same moment, so that their step times compare step by step.

    python benchmarks/side_by_side.py --peer hf_accelerate --rounds 2 --output_dir runs/side-by-side -- \\
        --config recipes/configs/hf_gpt2_small.yaml --config_name runs/hf_gpt2_small_8k/config \\
        --tokenizer_name runs/hf_gpt2_small_8k/tokenizer --mixed_precision no --max_steps 40 --log_every 20

On a machine whose speed swings from minute to minute (a virtual machine beside busy neighbours), runs taken in
turn (recipes/benchmark.py) differ by more than a few percent from run to run; two runs side by side do not
share that swing less than the steps of one run do. Each round starts both runs together through
benchmarks/step_profile.py (`--steps 0 --step_times`: every optimizer step's wall time, nothing profiled) with
`--cpu_threads 1`, the recipe on one core and the peer on the other; the next round swaps the cores, so that a
faster core favours neither. Per round: the median step time of each over the steps that do not log (the first
step, with the start-up, and every --log_every-th step left out) and the recipe's throughput over the peer's;
over the rounds, the geometric mean of those ratios. Beside it, the same over every step but the first (the mean
step time, logging steps included: which takes in what a logging step's measurements cost).
One thread each: this compares the steps' own work, not how a runner's threads share two cores
(recipes/benchmark.py measures that).

`--turns`: the two runs take turns instead, one optimizer step each (a token passed through two FIFOs:
step_profile.py's `--turns`), each with the threads it chooses itself (two on two cores), unpinned: every step
of one runs between two steps of the other, so that both meet the machine's state of the same seconds with
their threads sharing the cores as in a run of their own. A step's time counts from when its run got the turn
(the first step, with both start-ups at once, is left out as before); the recipe goes first in odd rounds, the
peer in even ones.

Flags after `--` go to both runners (the recipe's own extras, `--overwrite_output_dir --report_to none
--sample_tokens 0`, are added to it). `--peer recipe_checks_off` makes the peer the recipe itself with the checks
off (recipes/benchmark.py's row of that name: `--no-health_checks --no-lost_updates`), and `--recipe_flags
"FLAGS"` adds flags to the recipe's side only: so that one check's cost is measured against the same recipe
without it (`--peer recipe_checks_off --recipe_flags=--no-lost_updates`: the health checks alone). Needs two
usable cores (but for --turns). A run that fails ends the other and the script (exit code 1, naming its log).
Writes DIR/side_by_side.json (every step's time and its process's kernel counts: minor page faults, user and
system CPU seconds) and DIR/side_by_side.md, and each run's folder and log. `python benchmarks/side_by_side.py
--render DIR` writes both again from DIR/side_by_side.json's step times (nothing run).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_spec = importlib.util.spec_from_file_location("recipe_benchmark", REPO / "recipes" / "benchmark.py")
BENCHMARK = importlib.util.module_from_spec(_spec)  # recipes/benchmark.py: its recipe rows' flags and round order
_spec.loader.exec_module(BENCHMARK)  # no torch: it loads its own after its arguments
CHECKS_OFF = BENCHMARK.CHECKS_OFF

RECIPE_EXTRA = ["--overwrite_output_dir", "--report_to", "none", "--sample_tokens", "0"]
RECIPE_PEER = "recipe_checks_off"  # the recipe with CHECKS_OFF, as a peer of the recipe


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer", default="hf_accelerate", choices=("hf_accelerate", "hf_trainer", RECIPE_PEER))
    parser.add_argument("--recipe_flags", default="", help="flags for the recipe's side only (one string)")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs; cores swap each round (default: 2)")
    parser.add_argument("--output_dir", help="a new or empty folder")
    parser.add_argument("--render", metavar="DIR", help="write DIR's report again from its side_by_side.json")
    parser.add_argument("--turns", action="store_true",
                        help="take turns step by step, each with its own thread count, instead of one core each")
    args, flags = parser.parse_known_args(argv)
    flags = flags[1:] if flags[:1] == ["--"] else flags
    own = ("--rounds", "--peer", "--turns", "--recipe_flags")
    if args.render is not None and (args.output_dir or flags or any(a.startswith(own) for a in argv)):
        fail("--render DIR takes nothing else: the report is written again from DIR's own flags and step times")
    if args.render is not None or not args.output_dir:
        return args, flags, []
    if args.rounds < 1:
        fail(f"--rounds {args.rounds} must be at least 1")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 and not args.turns:
        fail(f"side by side needs two usable cores; this process may use {len(cores)}")
    out = Path(args.output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(f"--output_dir {out} is not a new or empty folder")
    steps, log_every = flag(flags, "--max_steps"), flag(flags, "--log_every")
    if log_every < 1 or not quiet_steps([0.0] * steps, log_every):
        fail(f"--max_steps {steps} --log_every {log_every} leave no step to compare: give steps beyond the first "
             f"that do not log, e.g. --max_steps 30 --log_every 15")
    return args, flags, cores[:2]


def flag(flags: list[str], name: str) -> int:
    """The integer value of `name` among the runners' flags (`--name N` or `--name=N`), or a one-line error."""
    for i, f in enumerate(flags):
        value = f.partition("=")[2] if f.startswith(name + "=") else (
            flags[i + 1] if f == name and i + 1 < len(flags) else None)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                fail(f"{name} {value!r} is not a whole number")
    fail(f"give {name} after `--` (the first step and the steps that log are left out of the comparison)")


def quiet_steps(times: list[float], log_every: int) -> list[float]:
    """Step times without the first step (start-up) and the steps that log (1-based step numbers)."""
    return [t for i, t in enumerate(times, 1) if i > 1 and i % log_every]


def compare(found: dict, peer: str, log_every: int, turns: bool = False) -> dict:
    """A round's figures from its step times: each runner's median over the steps that do not log and mean over
    every step but the first; the recipe's throughput over the peer's by each. Taking turns, also by the mean
    over the steps that do not log (`recipe_over_peer_means`): the two runs share the machine's minutes, and the
    mean counts every step's work where a median of steps spread by +-15% picks one of them (docs/benchmarks.md:
    on the same runs, medians and means 1-4% apart); and where the runs kept their kernel counts, by the CPU time
    of the same steps (`recipe_over_peer_cpu`), which a spell of the machine holding one run back does not
    lengthen, with the cores each kept busy (`busy_cores`)."""
    for runner in ("recipe", peer):
        times = found[runner]["step_times_s"]
        kept = quiet_steps(times, log_every)
        found[runner].update(median_step_s=statistics.median(kept), steps_compared=len(kept),
                             mean_step_s=statistics.fmean(times[1:]))
        if turns:
            found[runner]["mean_quiet_step_s"] = statistics.fmean(kept)
    found["recipe_over_peer"] = found[peer]["median_step_s"] / found["recipe"]["median_step_s"]
    found["recipe_over_peer_all_steps"] = found[peer]["mean_step_s"] / found["recipe"]["mean_step_s"]
    if turns:
        found["recipe_over_peer_means"] = found[peer]["mean_quiet_step_s"] / found["recipe"]["mean_quiet_step_s"]
    if turns and all("step_process" in found[runner] for runner in ("recipe", peer)):
        for runner in ("recipe", peer):  # CPU seconds (user + system, all threads) of the same steps
            cpu = [x["user_s"] + x["system_s"] for x in found[runner]["step_process"]]
            found[runner]["mean_quiet_cpu_s"] = statistics.fmean(quiet_steps(cpu, log_every))
            found[runner]["busy_cores"] = found[runner]["mean_quiet_cpu_s"] / found[runner]["mean_quiet_step_s"]
        found["recipe_over_peer_cpu"] = found[peer]["mean_quiet_cpu_s"] / found["recipe"]["mean_quiet_cpu_s"]
    return found


def summarise(report: dict) -> dict:
    """The geometric means over the rounds, each round's figures computed again from its step times."""
    log_every, turns = flag(report["flags"], "--log_every"), report.get("turns", False)
    rounds = [compare(r, report["peer"], log_every, turns) for r in report["rounds"]]
    for key in ("recipe_over_peer", "recipe_over_peer_all_steps", "recipe_over_peer_means", "recipe_over_peer_cpu"):
        if all(key in r for r in rounds):
            report[key] = math.exp(statistics.fmean(math.log(r[key]) for r in rounds))
    return report


def run_round(k: int, args, flags: list[str], cores: list[int], out: Path) -> dict:
    """Round k: both runs at once, on cores of their own (swapped each round), or taking turns (--turns; the
    recipe goes first in odd rounds, the peer in even ones)."""
    recipe_core, peer_core = (cores[0], cores[1]) if k % 2 else (cores[1], cores[0])
    if args.turns:
        fifos = [out / f"turn-{k}-to-recipe", out / f"turn-{k}-to-{args.peer}"]
        for fifo in fifos:
            os.mkfifo(fifo)
    procs = {}
    try:
        for i, (runner, core) in enumerate((("recipe", recipe_core), (args.peer, peer_core))):
            folder = out / f"{runner}-{k}"
            first = (i == 0) == bool(k % 2)
            how = ["--turns", str(fifos[i]), str(fifos[1 - i]), str(int(first))] if args.turns else []
            cmd = [sys.executable, "benchmarks/step_profile.py", "--runner", "recipe" if runner == RECIPE_PEER else
                   runner, "--steps", "0", "--step_times", str(folder / "step_times.json"), *how, "--", *flags,
                   *([] if args.turns else ["--cpu_threads", "1"]), "--output_dir", str(folder / "run"),
                   *own_flags(runner, args.recipe_flags)]
            folder.mkdir(parents=True)
            pin = None if args.turns else (lambda c=core: os.sched_setaffinity(0, {c}))
            with open(folder / "run.log", "w") as log:
                procs[runner] = (subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                                  preexec_fn=pin), None if args.turns else core, cmd)
        codes, ended = wait_both({runner: proc for runner, (proc, _, _) in procs.items()})
    finally:  # a failed start or an interrupt: the other run does not go on alone
        for proc, _, _ in procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    found = {"round": k, **({"first": "recipe" if k % 2 else args.peer} if args.turns else {})}
    for runner, (_, core, cmd) in sorted(procs.items(), key=lambda item: item[0] in ended):  # the failed one first
        times_file = out / f"{runner}-{k}" / "step_times.json"
        if codes[runner] or not times_file.is_file():
            print(f"error: round {k}: {runner} ended with exit code {codes[runner]}: see "
                  f"{out / f'{runner}-{k}' / 'run.log'}", file=sys.stderr)
            sys.exit(1)
        record = json.loads(times_file.read_text())
        found[runner] = {"core": core, "step_times_s": record["step_times_s"], "command": " ".join(cmd),
                         **{key: record[key] for key in ("step_spans", "step_process") if key in record}}
    return compare(found, args.peer, flag(flags, "--log_every"), args.turns)


def own_flags(runner: str, recipe_flags: str) -> list[str]:
    """The flags one side gets beyond those after `--`."""
    if runner == "recipe":
        return [*RECIPE_EXTRA, *shlex.split(recipe_flags)]
    return [*RECIPE_EXTRA, *CHECKS_OFF] if runner == RECIPE_PEER else []


def wait_both(procs: dict) -> tuple[dict, set]:
    """Exit codes of both runs, and the runs ended here: one that fails ends the other (which may be waiting for
    its turn; the recipe checkpoints on SIGTERM and exits 75, so it is given 60 s before SIGKILL)."""
    ended = set()
    while True:
        codes = {runner: proc.poll() for runner, proc in procs.items()}
        if all(code is not None for code in codes.values()) or any(codes.values()):
            for runner, proc in procs.items():
                if proc.poll() is None:
                    proc.terminate()
                    ended.add(runner)
            for proc in procs.values():
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
            return {runner: proc.wait() for runner, proc in procs.items()}, ended
        time.sleep(0.2)


def markdown(report: dict) -> str:
    peer, turns = report["peer"], report.get("turns", False)
    if turns:
        how = "taking turns step by step, each with its own threads, the first to go swapped each round"
        head = f"| round | goes first | recipe step (median) | {peer} step (median) |"
    else:
        how = "1 thread each on cores of their own, cores swapped each round"
        head = f"| round | recipe core | recipe step (median) | {peer} core | {peer} step (median) |"
    cpu = "recipe_over_peer_cpu" in report

    def busy(runner: str) -> str:
        return ", ".join(f"{r[runner]['busy_cores']:.2f}" for r in report["rounds"])
    means = (f" recipe/{peer}, means |" if turns else "") + (f" recipe/{peer}, CPU time |" if cpu else "")
    lines = [f"**The recipe and {peer} side by side, {how}; {report['hardware']}**", "",
             f"{head} recipe/{peer} |{means} recipe/{peer}, all steps |", "|---" * (7 + cpu) + "|"]
    for r in report["rounds"]:
        a, b = r["recipe"], r[peer]
        ms = [f"{x['median_step_s'] * 1e3:,.1f} ms" for x in (a, b)]
        steps = f"{r['first']} | {ms[0]} | {ms[1]}" if turns else f"{a['core']} | {ms[0]} | {b['core']} | {ms[1]}"
        lines.append(f"| {r['round']} | {steps} | {r['recipe_over_peer']:.3f} |"
                     + (f" {r['recipe_over_peer_means']:.3f} |" if turns else "")
                     + (f" {r['recipe_over_peer_cpu']:.3f} |" if cpu else "")
                     + f" {r['recipe_over_peer_all_steps']:.3f} |")
    rounds = len(report["rounds"])
    lines += ["", f"Recipe's throughput over {peer}'s, geometric mean of {rounds} rounds: "
              f"**{report['recipe_over_peer']:.3f}x** (steps compared: all but the first and the logging steps).",
              *(["", f"The same steps by their mean times (taking turns the two runs share the machine's minutes, and "
                     f"the mean counts every step), geometric mean of "
                     f"{rounds} rounds: **{report['recipe_over_peer_means']:.3f}x**."] if turns else []),
              *(["", f"The same steps by their CPU time (user and system seconds of all threads, from getrusage: "
                     f"the work each did, which a spell of the machine holding a run back does not lengthen), the "
                     f"peer's over the recipe's, geometric mean of {rounds} rounds: "
                     f"**{report['recipe_over_peer_cpu']:.3f}x**. CPU seconds per second of those steps (the cores "
                     f"each kept busy: below its thread count, its threads waited, for the machine or for their "
                     f"own work), by round: recipe "
                     f"{busy('recipe')}; {peer} {busy(peer)}."] if cpu else []),
              "", f"The same over every step but the first (mean step times, the logging steps included), geometric "
              f"mean of {rounds} rounds: **{report['recipe_over_peer_all_steps']:.3f}x**.",
              "", "Flags given to both:", "", f"    {' '.join(report['flags'])}"]
    if report.get("recipe_flags"):
        lines += ["", "Flags given to the recipe only:", "", f"    {' '.join(report['recipe_flags'])}"]
    if peer == RECIPE_PEER:
        lines += ["", f"{RECIPE_PEER} is the recipe with {' '.join(CHECKS_OFF)}."]
    return "\n".join(lines) + "\n"


def render(folder: Path) -> dict:
    """DIR/side_by_side.json and .md written again from the step times recorded in the JSON (nothing run)."""
    found = folder / "side_by_side.json"
    try:  # both texts made before either file is written
        report = summarise(json.loads(found.read_text()))
        text, md = json.dumps(report, indent=2) + "\n", markdown(report)
    except (OSError, ValueError, KeyError, IndexError, TypeError, ZeroDivisionError,
            statistics.StatisticsError) as err:
        fail(f"--render {folder}: {found} is not a side-by-side report ({type(err).__name__}: {err})")
    found.write_text(text)
    (folder / "side_by_side.md").write_text(md)
    print(md + f"\nwrote {folder}/side_by_side.json, side_by_side.md")
    return report


def main(argv: list[str] | None = None) -> dict:
    args, flags, cores = parse(sys.argv[1:] if argv is None else argv)
    if args.render is not None:
        return render(Path(args.render))
    if not args.output_dir:
        fail("give --output_dir DIR (a new or empty folder), or --render DIR")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    from mixprec.devices.hardware import machine_line  # torch: loaded only once the arguments are good

    report = {"peer": args.peer, "flags": flags, "hardware": machine_line(), "rounds": [],
              **({"turns": True} if args.turns else {}),
              **({"recipe_flags": shlex.split(args.recipe_flags)} if args.recipe_flags else {})}
    for k in range(1, args.rounds + 1):
        report["rounds"].append(run_round(k, args, flags, cores, out))
        r = report["rounds"][-1]
        where = f"{r['first']} first" if args.turns else f"core {r['recipe']['core']}"
        print(f"round {k}: recipe {r['recipe']['median_step_s'] * 1e3:.1f} ms ({where}), "
              f"{args.peer} {r[args.peer]['median_step_s'] * 1e3:.1f} ms: recipe/{args.peer} "
              f"{r['recipe_over_peer']:.3f}", flush=True)
    summarise(report)
    (out / "side_by_side.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "side_by_side.md").write_text(markdown(report))
    print("\n" + markdown(report) + f"\nwrote {out}/side_by_side.json, side_by_side.md")
    return report


if __name__ == "__main__":
    main()
