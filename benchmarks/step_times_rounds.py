#!/usr/bin/env python
"""Whole runs of the recipe and its transformers peers in rotated rounds, every optimizer step timed: is a gap in
the steps that do not log, or in the logging steps?

    python benchmarks/step_times_rounds.py --runners recipe,recipe_checks_off,hf_accelerate --rounds 6 \\
        --output_dir DIR -- --config recipes/configs/hf_gpt2_small.yaml --config_name runs/hf_gpt2_small_8k/config \\
        --tokenizer_name runs/hf_gpt2_small_8k/tokenizer --mixed_precision no --max_steps 50 --log_every 25

Each run is `benchmarks/step_profile.py --steps 0 --step_times` (nothing profiled: the wall time of every
optimizer step, from one optimizer step's end to the next) with the flags after `--`; the recipe's rows get
what recipes/benchmark.py gives them (no tracker, no text sample, one checkpoint; `recipe_checks_off` also
`--no-health_checks --no-lost_updates`). Round r runs the rows rotated by r - 1, as recipes/benchmark.py does.

The window is recipes/benchmark.py's: the steps after the first logging step up to the last one (26-50 for 50
steps logged every 25). It splits into the logging steps (the recipe's lost-update measurement falls in their
optimizer step), the steps right after a logging step (that log's own work falls in them) and the ordinary
steps. Writes DIR/<row>-r<round>.json (the step times), DIR/summary.json and summary.md (per round and row: the
window's mean, the ordinary steps' mean, the two kinds' extra time over that mean, the load average before and
after, and the ordinary steps' CPU time, busy cores and minor page faults from each step's kernel counts; for
each recipe row against each row after it: the speed ratio of every round, by the window's and the ordinary
steps' wall time and by the ordinary steps' CPU time, and its median) and prints the table. Exit code 2 with
one line for bad flags (before any run), 1 when a run fails. `--render DIR` writes a finished folder's summary
again from its step times.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from mixprec import benchmarking as bm
from mixprec.benchmark_rounds import RUNNERS as ORDER
from side_by_side import BENCHMARK, fail, flag  # this folder's: recipes/benchmark.py, one-line errors, int flags

REPO = Path(__file__).resolve().parent.parent
ROWS = (*BENCHMARK.RECIPE_ROWS, "hf_accelerate", "hf_trainer")


def command(row: str, flags: list[str], out: Path, rnd: int) -> list[str]:
    runner = "recipe" if row in BENCHMARK.RECIPE_ROWS else row
    cmd = [sys.executable, str(REPO / "benchmarks/step_profile.py"), "--runner", runner, "--steps", "0",
           "--step_times", str(out / f"{row}-r{rnd}.json"), "--", *flags, "--output_dir",
           str(out / "runs" / f"{row}-r{rnd}")]
    if runner == "recipe":
        cmd += BENCHMARK.RECIPE_EXTRA + (BENCHMARK.CHECKS_OFF if row == "recipe_checks_off" else [])
    return cmd


def split(times: list[float], log_every: int, process: list[dict] | None = None) -> dict:
    """The window's parts (seconds) from one run's step times (times[i]: optimizer step i + 1): its mean, the mean
    of its ordinary steps, and the extra time over that of its logging steps and of the steps right after one.
    With the run's per-step kernel counts (`process`, step_profile.py's `step_process`), also the ordinary steps'
    mean CPU time (user + system, all threads), the cores that kept busy (CPU time over wall time) and their
    mean minor page faults: CPU time is what a spell of the machine holding the run back does not lengthen."""
    first, last = log_every, len(times) // log_every * log_every  # the first and the last logging step
    steps = range(first + 1, last + 1)
    logging = [times[s - 1] for s in steps if s % log_every == 0]
    after = [times[s - 1] for s in steps if s % log_every == 1 % log_every]
    ordinary_steps = [s for s in steps if s % log_every not in (0, 1 % log_every)]
    mean = statistics.fmean(times[s - 1] for s in ordinary_steps)
    parts = {"window_s": statistics.fmean(times[first:last]), "ordinary_s": mean,
             "after_log_extra_s": statistics.fmean(after) - mean, "log_step_extra_s": statistics.fmean(logging) - mean}
    if process:
        cpu = statistics.fmean(process[s - 1]["user_s"] + process[s - 1]["system_s"] for s in ordinary_steps)
        parts.update(ordinary_cpu_s=cpu, ordinary_busy_cores=cpu / mean,
                     ordinary_minor_faults=statistics.fmean(process[s - 1]["minor_faults"] for s in ordinary_steps))
    return parts


def pairs(rows: list[str]) -> list[tuple[str, str]]:
    """Each recipe row against every row after it."""
    return [(a, b) for i, a in enumerate(rows) if a in BENCHMARK.RECIPE_ROWS for b in rows[i + 1:]]


def summarize(rounds: dict[int, dict[str, dict]], rows: list[str]) -> dict:
    """Per pair (a, b): a's speed over b's (b's time / a's) in each round, for the window and the ordinary steps."""
    out = {}
    for a, b in pairs(rows):
        both = [r for r in sorted(rounds) if a in rounds[r] and b in rounds[r]]
        counted = both and all("ordinary_cpu_s" in rounds[r][x] for r in both for x in (a, b))
        for part in ("window_s", "ordinary_s", *(["ordinary_cpu_s"] if counted else [])):
            speed = [rounds[r][b][part] / rounds[r][a][part] for r in both]
            out[f"{a}/{b} {part[:-2]}"] = {"rounds": speed, "median": statistics.median(speed) if speed else None,
                                           "behind": sum(s < 1 for s in speed)}
    return out


def _one_minute(load) -> str:
    return f"{load[0]:.2f}" if load else "-"


def _counts(x: dict) -> str:
    return (f" {x['ordinary_cpu_s'] * 1e3:,.0f} ({x['ordinary_busy_cores']:.2f}) | "
            f"{x['ordinary_minor_faults'] / 1e3:,.0f}k |" if "ordinary_cpu_s" in x else " - | - |")


def table(rounds: dict[int, dict[str, dict]], ratios: dict) -> str:
    counted = any("ordinary_cpu_s" in x for r in rounds.values() for x in r.values())
    lines = ["| round | row | window ms/step | ordinary steps | step after the first log (extra) | "
             "logging step (extra) | load before / after |" + (" ordinary steps' CPU ms (cores busy) | their "
                                                                "minor faults |" if counted else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if counted else "")]
    for r in sorted(rounds):
        for row, x in rounds[r].items():
            lines.append(f"| {r} | {row} | {x['window_s'] * 1e3:,.0f} | {x['ordinary_s'] * 1e3:,.0f} | "
                         f"{x['after_log_extra_s'] * 1e3:+,.0f} | {x['log_step_extra_s'] * 1e3:+,.0f} | "
                         f"{_one_minute(x['loadavg_before'])} / {_one_minute(x['loadavg_after'])} |"
                         + (_counts(x) if counted else ""))
    lines += ["", "| speed: the first row over the second (the second's time / the first's) | by round | median | "
              "rounds behind |", "|---|---|---|---|"]
    for name, x in ratios.items():
        lines.append(f"| {name} | {', '.join(f'{s:.3f}' for s in x['rounds'])} | {x['median']:.3f} | "
                     f"{x['behind']} of {len(x['rounds'])} |")
    return "\n".join(lines)


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runners", default="recipe,recipe_checks_off,hf_accelerate",
                        help=f"two or more of {','.join(ROWS)} (default: recipe,recipe_checks_off,hf_accelerate)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds; the rows rotate each round (default: 6)")
    parser.add_argument("--output_dir", required=True, help="a new or empty folder")
    args, flags = parser.parse_known_args(argv)
    flags = flags[1:] if flags[:1] == ["--"] else flags
    asked = args.runners.split(",")
    if not set(asked) <= set(ROWS) or len(set(asked)) < 2:
        fail(f"--runners {args.runners}: give two or more of {','.join(ROWS)}")
    if args.rounds < 1:
        fail(f"--rounds {args.rounds} must be at least 1")
    out = Path(args.output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(f"--output_dir {out} is not a new or empty folder")
    steps, log_every = flag(flags, "--max_steps"), flag(flags, "--log_every")
    if log_every < 3 or steps < 2 * log_every:
        fail(f"--max_steps {steps} --log_every {log_every}: the window runs from the first logging step to the last "
             f"and needs steps that neither log nor follow one: e.g. --max_steps 50 --log_every 25")
    return args, flags, sorted(set(asked), key=ORDER.index), log_every


def write(out: Path, machine: dict, flags: list[str], rows: list[str], rounds: dict[int, dict[str, dict]]) -> dict:
    ratios = summarize(rounds, rows)
    summary = {"machine": machine, "flags": flags, "rows": rows, "rounds": rounds, "speed": ratios}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(table(rounds, ratios) + "\n")
    print(table(rounds, ratios) + f"\nwrote {out}/summary.json, summary.md")
    return summary


def render(out: Path) -> dict:
    """summary.json and summary.md again from a finished folder's step times (<row>-r<round>.json), keeping what
    was measured around each run (its order, the load)."""
    if not (out / "summary.json").is_file():
        fail(f"--render {out}: no summary.json there (a folder this script wrote)")
    old = json.loads((out / "summary.json").read_text())
    log_every = flag(old["flags"], "--log_every")
    derived = set(split([1.0] * 3 * log_every, log_every, [{"user_s": 1, "system_s": 0, "minor_faults": 0}] * 3 *
                        log_every))  # the keys split computes: computed again, never kept from before
    rounds = {}
    for rnd, runs in old["rounds"].items():
        for row, kept in runs.items():
            record = json.loads((out / f"{row}-r{rnd}.json").read_text())
            measured = {k: v for k, v in kept.items() if k not in derived}  # the order, the load around the run
            rounds.setdefault(int(rnd), {})[row] = {**split(record["step_times_s"], log_every,
                                                            record.get("step_process")), **measured}
    return write(out, old["machine"], old["flags"], old["rows"], rounds)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--render"] and len(argv) == 2:
        return render(Path(argv[1]))
    args, flags, rows, log_every = parse(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rounds: dict[int, dict[str, dict]] = {}
    for rnd in range(1, args.rounds + 1):
        order = BENCHMARK.round_order(rows, rnd)
        for row in order:
            cmd = command(row, flags, out, rnd)
            print(f"[round {rnd}] {' '.join(['python', *cmd[1:]])}", flush=True)
            before, meter = bm.loadavg(), bm.LoadMeter()
            with open(out / f"{row}-r{rnd}.log", "w") as log:
                code = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
            if code:
                print(f"error: round {rnd}: {row} ended with exit code {code}: see {out / f'{row}-r{rnd}.log'}",
                      file=sys.stderr)
                sys.exit(1)
            record = json.loads((out / f"{row}-r{rnd}.json").read_text())
            parts = split(record["step_times_s"], log_every, record.get("step_process"))
            rounds.setdefault(rnd, {})[row] = {**parts, "order": order,
                                               "loadavg_before": before, **meter.stop()}
    return write(out, bm.machine(), flags, rows, rounds)


if __name__ == "__main__":
    main()
