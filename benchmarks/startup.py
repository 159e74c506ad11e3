#!/usr/bin/env python
"""Start-up and shut-down: the default command against the floor of a launched Accelerate script, in turn.

    python benchmarks/startup.py                      # 5 pairs, 20 training steps: about 3 minutes on 2 cores
    python benchmarks/startup.py --repeats 3 --max_steps 20 --output runs/startup-quick

Each pair runs `accelerate launch benchmarks/minimal_accelerate.py` (import torch and accelerate, build an
Accelerator, one AdamW step: nothing of mixprec) and `accelerate launch recipes/train.py --max_steps N
--output_dir DIR/runs/<i>` (the default command, shortened), alternating which goes first. Reported: each
command's wall time (median, min, max), the recipe's own training time (its `done: N steps in Xs` line), and
the recipe's cost beyond the floor, pair by pair (median), with and without its training time; and the
recipe's wall time split, from its summary.json's `timeline`: start-up (the command's start to the first
training batch: the launcher, imports, checks, data, model), steps (the training steps, evaluation and
checkpoints left out), evaluation, checkpoints, and the end (the final save, metrics.png, summary.json, the
processes' exit). The five add up to the command's wall time. Both commands run with the same environment.
Writes DIR/startup.json (default DIR: runs/startup-<date>-<time>); refuses a DIR that is not empty.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


PARTS = ("start_up", "steps", "evaluation", "checkpoints", "end")


def timed(command: list[str]) -> tuple[float, str, tuple[float, float]]:
    """(wall seconds, output, (epoch start, epoch end)) of one command."""
    began, started = time.time(), time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(command)} failed with exit code {proc.returncode}: {proc.stderr[-500:]}")
    return wall, proc.stdout + proc.stderr, (began, began + wall)


def split(run_dir: Path, span: tuple[float, float]) -> dict:
    """The recipe's wall time in PARTS, from its summary.json's timeline and the command's start and end."""
    t = json.loads((run_dir / "summary.json").read_text())["timeline"]
    steps = t["finish"] - t["first_batch"] - t["evaluation_s"] - t["checkpoints_s"]
    return {"start_up": t["first_batch"] - span[0], "steps": steps, "evaluation": t["evaluation_s"],
            "checkpoints": t["checkpoints_s"], "end": span[1] - t["finish"]}


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="pairs of runs (default 5)")
    parser.add_argument("--max_steps", type=int, default=20, help="the recipe's training steps (default 20)")
    parser.add_argument("--output", type=Path, help="folder for startup.json (default runs/startup-<date>-<time>)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.max_steps < 1:
        parser.exit(2, "error: --repeats and --max_steps must be at least 1\n")
    out = args.output or REPO / "runs" / f"startup-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists() and any(out.iterdir()):
        parser.exit(2, f"error: --output {out} is not empty: give a new folder\n")
    out.mkdir(parents=True, exist_ok=True)
    launch = ["accelerate", "launch"]
    floor_cmd = [*launch, "benchmarks/minimal_accelerate.py"]
    floor, recipe, training, beyond, beyond_training, parts = [], [], [], [], [], []
    for i in range(args.repeats):
        recipe_cmd = [*launch, "recipes/train.py", "--max_steps", str(args.max_steps),
                      "--output_dir", str(out / "runs" / str(i))]
        order = [("floor", floor_cmd), ("recipe", recipe_cmd)]
        walls = {}
        for name, command in (order if i % 2 == 0 else order[::-1]):
            walls[name], text, span = timed(command)
            if name == "recipe":
                match = re.search(r"done: \d+ steps in ([\d.]+)s", text)
                walls["training"] = float(match.group(1)) if match else float("nan")
                parts.append(split(out / "runs" / str(i), span))
        floor.append(walls["floor"])
        recipe.append(walls["recipe"])
        training.append(walls["training"])
        beyond.append(walls["recipe"] - walls["floor"])
        beyond_training.append(walls["recipe"] - walls["training"] - walls["floor"])
        print(f"pair {i + 1}/{args.repeats}: floor {walls['floor']:.2f} s, recipe {walls['recipe']:.2f} s "
              f"(training {walls['training']:.2f} s)", flush=True)
    from mixprec.devices.hardware import machine_line

    report = {"machine": machine_line(), "python": platform.python_version(), "cores": os.cpu_count(),
              "max_steps": args.max_steps, "repeats": args.repeats, "floor_s": summary(floor),
              "recipe_s": summary(recipe), "recipe_training_s": summary(training),
              "recipe_beyond_floor_s": summary(beyond),
              "recipe_beyond_floor_without_training_s": summary(beyond_training),
              "recipe_split_s": {part: summary([p[part] for p in parts]) for part in PARTS}}
    (out / "startup.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"floor {report['floor_s']['median']:.2f} s, recipe {report['recipe_s']['median']:.2f} s; the recipe's cost "
          f"beyond the floor: {report['recipe_beyond_floor_s']['median']:.2f} s, "
          f"{report['recipe_beyond_floor_without_training_s']['median']:.2f} s without its training "
          f"(medians of {args.repeats} pairs); {out / 'startup.json'}\nthe recipe's wall time: " +
          ", ".join(f"{part.replace('_', '-')} {report['recipe_split_s'][part]['median']:.2f} s" for part in PARTS))


if __name__ == "__main__":
    main()
