#!/usr/bin/env python
"""What each measurement the recipe makes during training costs, each with its switch, the recipe run with it on
and off in turn (on, off, on, off, ...) so that the machine's drift hits both alike:

- lost updates (`--no-lost_updates`): on a logging step, a copy of the weights before the optimizer step and a
  pass over every element after it. Measured with --log_every 1 (every step logs), so the difference is its
  cost per logging step; at the default --log_every 50 it is paid on one step in 50;
- health checks (`--no-health_checks`): one host read per optimizer step;
- label probe (`--label_probe_samples 0`): classification only, once, after the first step (run time, not step
  time: compared as whole runs).

    python benchmarks/measurement_costs.py                          # gpt_tiny on the stdlib, mlp for the probe
    python benchmarks/measurement_costs.py --config recipes/configs/gpt_small.yaml --steps 30 --repeats 3

Step time: the median of the logged windows' step_time_s after the first two (the recipe's own timing of a
step: forward, backward, clip, optimizer step). Prints a table and writes --output (JSON) with the CPU named.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mixprec.devices.hardware import machine_line

TRAIN = Path(__file__).resolve().parents[1] / "recipes" / "train.py"
SWITCHES = {"lost updates": ("--no-lost_updates", ["--log_every", "1"]),
            "health checks": ("--no-health_checks", ["--log_every", "1"]),
            "label probe": ("--label_probe_samples", "0")}


def run(out: Path, base: list[str], extra: list[str]) -> tuple[float, float]:
    """(median step time, whole run's wall time) of one recipe run."""
    start = time.perf_counter()
    subprocess.run([sys.executable, str(TRAIN), *base, "--report_to", "none", "--output_dir", str(out), *extra],
                   check=True, capture_output=True)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records if "step_time_s" in r][2:]
    return (statistics.median(times) if times else float("nan")), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="recipes/configs/gpt_tiny.yaml", help="the run for the step costs")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None, help="a folder for measurement_costs.md and .json")
    args = parser.parse_args()
    if args.output is not None:  # made now: a folder that cannot be made is said before the runs, not after
        try:
            args.output.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            parser.exit(2, f"error: --output {args.output}: {err.strerror or err}: give a folder for "
                           f"measurement_costs.md and .json\n")
    step_run = ["--config", args.config, "--max_steps", str(args.steps)]
    probe_run = ["--max_steps", "20", "--log_every", "10"]  # the default MLP on the synthetic classes
    rows = {}
    with tempfile.TemporaryDirectory() as root:
        for name, (flag, extra) in SWITCHES.items():
            base = probe_run if name == "label probe" else [*step_run, *extra]
            off = [flag, extra] if name == "label probe" else [flag]
            got = {"on": [], "off": []}
            for i in range(args.repeats):
                for side, more in (("on", []), ("off", off)):
                    got[side].append(run(Path(root) / f"{name}-{side}-{i}".replace(" ", "_"), base, more))
                    print(f"{name} {side:3} run {i + 1}: step {got[side][-1][0] * 1e3:8.2f} ms, run "
                          f"{got[side][-1][1]:.2f} s, load {os.getloadavg()[0]:.1f}", flush=True)
            which = 1 if name == "label probe" else 0
            on, off_ = (statistics.median(r[which] for r in got[s]) for s in ("on", "off"))
            rows[name] = {"switch": " ".join(off), "measure": "run wall time (s)" if which else "step time (ms)",
                          "on": on * (1 if which else 1e3), "off": off_ * (1 if which else 1e3),
                          "runs": {s: [list(r) for r in got[s]] for s in got}}
    lines = [f"{machine_line()}; steps: `{' '.join(step_run)}` with --log_every 1; label probe: "
             f"`{' '.join(probe_run)}` (the default MLP); {args.repeats} interleaved pairs, medians; "
             f"load average at the end {os.getloadavg()[0]:.1f}", "",
             "| measurement | switch | measured | on | off | cost |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | `{r['switch']}` | {r['measure']} | {r['on']:.3f} | {r['off']:.3f} | "
                     f"{r['on'] - r['off']:+.3f} ({(r['on'] - r['off']) / r['off']:+.1%}) |")
    print("\n".join(lines))
    if args.output:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "measurement_costs.md").write_text("\n".join(lines) + "\n")
        (args.output / "measurement_costs.json").write_text(json.dumps({"machine": machine_line(), **rows},
                                                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
