#!/usr/bin/env python
"""What the precision report's fp8 section costs: the CPU time of one batch's fp32 forward and backward passes
of the tiny GPT (recipes/configs/gpt_tiny.yaml: batch 32 of 64 tokens, 2,048 tokens), without and with the
fp8 readiness hooks (mixprec.doctor.fp8.collect: each Linear layer's input and output gradient through E4M3 and
E5M2 with three scaling recipes), and of the weights' pass (mixprec.doctor.fp8.readiness).

    python benchmarks/fp8_readiness_cost.py --output_dir benchmarks/results/cpu-fp8-readiness-amd-avx512bf16

Each figure is the median of --repeats passes, in process CPU time (time.process_time: all threads of this
process), after one warm-up pass; torch threads as torch chooses. Writes DIR/fp8_readiness_cost.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from mixprec.devices import hardware
from mixprec import models
from mixprec.doctor import fp8
from mixprec.evaluation import loss_fn


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output_dir", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = models.build("gpt_tiny", {"task": "language_modeling", "vocab_size": 256, "block_size": 64})
    inputs, labels = torch.randint(0, 256, (32, 64)), torch.randint(0, 256, (32, 64))

    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(model(inputs), labels).backward()

    def hooked():
        layers = {}
        with fp8.collect(model, layers):
            step()
        fp8.readiness(model, layers)

    load_before = os.getloadavg()[0]
    plain, with_fp8 = timed(step, args.repeats), timed(hooked, args.repeats)
    result = {"model": "gpt_tiny", "tokens": 32 * 64, "repeats": args.repeats, "cpu": hardware.cpu_name(),
              "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
              "fp32_step_cpu_s": plain, "with_fp8_readiness_cpu_s": with_fp8, "fp8_section_cpu_s": with_fp8 - plain,
              "load_average": [load_before, os.getloadavg()[0]]}
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "fp8_readiness_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    md = (f"| model | tokens | fp32 forward + backward (CPU s) | with fp8 readiness (CPU s) | fp8 section (CPU s) |\n"
          f"|---|---|---|---|---|\n| gpt_tiny | {result['tokens']} | {plain:.3f} | {with_fp8:.3f} | {with_fp8 - plain:.3f} |\n"
          f"\n{result['cpu']}, {result['threads']} torch threads, torch {result['torch']}, median of {args.repeats}; "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after (other processes on the machine)\n")
    (args.output_dir / "fp8_readiness_cost.md").write_text(md)
    print(md, end="")


if __name__ == "__main__":
    main()
