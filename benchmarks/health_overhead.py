#!/usr/bin/env python
"""What the health checks cost per optimizer step: the recipe itself, with and without them
(--no-health_checks), run in turn (on, off, on, off, ...) so that the machine's drift hits both alike.

    python benchmarks/health_overhead.py                                  # the default job, 600 steps, 3 pairs
    python benchmarks/health_overhead.py --mixed_precision fp16 --steps 300 --repeats 5

Each run is `python recipes/train.py --max_steps N --log_every 50 --report_to none` in its own folder; its
step time is the median of its logged windows after the first. The report gives the median over repeats of
each, their difference, and the spread. On a CPU a host sync costs next to nothing; on a GPU it also stops
the CPU from queueing the next step's kernels, which shows only when this runs on a GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mixprec.devices.hardware import machine_line

TRAIN = Path(__file__).resolve().parents[1] / "recipes" / "train.py"


def step_time(out: Path, args, health: bool) -> float:
    cmd = [sys.executable, str(TRAIN), "--mixed_precision", args.mixed_precision, "--max_steps", str(args.steps),
           "--log_every", "50", "--report_to", "none", "--output_dir", str(out),
           "--health_checks" if health else "--no-health_checks"]
    subprocess.run(cmd, check=True, capture_output=True)
    windows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in windows if "step_time_s" in r][1:]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mixed_precision", default="auto", choices=("auto", "no", "fp16", "bf16"))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times = {True: [], False: []}
    with tempfile.TemporaryDirectory() as root:
        for i in range(args.repeats):
            for health in (True, False):
                t = step_time(Path(root) / f"{'on' if health else 'off'}-{i}", args, health)
                times[health].append(t)
                print(f"health checks {'on ' if health else 'off'} run {i + 1}: {t * 1e6:8.1f} us/step", flush=True)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"\n{machine_line()}; --mixed_precision {args.mixed_precision}, {args.steps} steps, {args.repeats} runs each")
    print(f"with health checks:    {on * 1e6:8.1f} us/step (runs {min(times[True]) * 1e6:.0f}-{max(times[True]) * 1e6:.0f})")
    print(f"without health checks: {off * 1e6:8.1f} us/step (runs {min(times[False]) * 1e6:.0f}-{max(times[False]) * 1e6:.0f})")
    print(f"cost: {(on - off) * 1e6:+.1f} us/step ({(on - off) / off:+.1%})")


if __name__ == "__main__":
    main()
