#!/usr/bin/env python
"""The README's model x precision table: run each recipe config in each precision, read summary.json, print a
Markdown table with the hardware and the commands.

    python benchmarks/scale_table.py                       # cnn_digits, gpt_tiny, gpt_small (100 steps); fp32, bf16
    python benchmarks/scale_table.py --models gpt_tiny --precisions no bf16 fp16

Each run is `python recipes/train.py --config recipes/configs/<model>.yaml --mixed_precision <p> [extra]`,
in its own folder under --output_dir (logs in run.log). Numbers are whole-run averages from summary.json
(evaluation and checkpoint time left out). Timings depend on what else runs on the machine: run it alone.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from mixprec.devices.hardware import machine_line

REPO = Path(__file__).resolve().parents[1]

# model config -> extra flags (keep CPU runs short: gpt_small's config trains for 2,000 steps)
RUNS = {"cnn_digits": [], "gpt_tiny": [], "gpt_small": ["--max_steps", "100", "--eval_steps", "100"]}
NAMES = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def run(model: str, precision: str, out: Path, extra: list[str]) -> tuple[dict, str]:
    cmd = [sys.executable, "recipes/train.py", "--config", f"recipes/configs/{model}.yaml",
           "--mixed_precision", precision, *RUNS[model], *extra, "--output_dir", str(out), "--overwrite_output_dir"]
    shown = " ".join(["python", *cmd[1:-3]])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "run.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"error: {shown} exited {proc.returncode}; see {out / 'run.log'}")
    return json.loads((out / "summary.json").read_text()), shown


def row(model: str, precision: str, s: dict) -> str:
    speed = f"{s['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in s else f"{s['samples_per_s']:,.0f} samples/s"
    metric = (f"val_loss {s['val_loss']:.3f}" if "tokens_per_s" in s else f"val_accuracy {s['val_accuracy']:.3f}")
    mfu = f"{s['mfu']:.1%}" if s.get("mfu") else "n/a"
    return (f"| {model} | {NAMES[precision]} | {s['steps']} | {speed} | {s['step_time_s'] * 1e3:,.0f} ms "
            f"| {s['data_wait_frac']:.1%} | {mfu} | {s['peak_memory_bytes'] / 2**30:.2f} GiB | {metric} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--precisions", nargs="+", default=["no", "bf16"], choices=list(NAMES))
    parser.add_argument("--output_dir", default="runs/scale_table")
    parser.add_argument("--extra", default="", help="more flags for every run, e.g. '--cpu_threads 2'")
    args = parser.parse_args()
    started, lines, commands = time.time(), [], []
    jobs = [(m, p) for m in args.models for p in args.precisions]
    for model, precision in tqdm(jobs, desc="benchmark runs", unit="run"):
        summary, shown = run(model, precision, Path(args.output_dir) / f"{model}-{precision}", args.extra.split())
        lines.append(row(model, precision, summary))
        commands.append(shown)
    print(f"\nHardware: {machine_line()}; {time.time() - started:.0f} s in all.\n")
    print("| model | precision | steps | throughput | step time | waiting for data | MFU | peak memory "
          "| final validation |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    print("\nCommands:\n" + "\n".join(f"    {c}" for c in commands))


if __name__ == "__main__":
    main()
