#!/usr/bin/env python
"""What the health checks cost per optimizer step: the time spent inside `monitor.check` and
`monitor.after_step` (one host sync reading the loss and gradient norm, and the watch's bookkeeping),
next to the time of the whole training step, for the lesson's MLP on the synthetic data.

    python benchmarks/health_overhead.py                       # bf16 where native, else fp32; 600 steps
    python benchmarks/health_overhead.py --mixed_precision fp16 --steps 300

Reports medians over steps of wall-clock and process CPU time. On a CPU a host sync costs nothing; on a
GPU the sync also stops the CPU from queueing the next step's kernels while the current step runs, which
this script does not measure unless it runs on a GPU.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from mixprec import config, data, health, models, optim, precision, tracking

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
from train import loss_fn  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mixed_precision", default="auto", choices=config.PRECISIONS)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    cfg = config.parse_config(["--mixed_precision", args.mixed_precision])
    accelerator, prec = precision.build_accelerator(cfg)
    bundle = data.build(cfg)
    loader, _ = data.loaders(bundle, cfg)
    model = models.build(cfg.model, bundle.info, cfg.model_args)
    optimizer = optim.adamw(model, cfg.lr, cfg.weight_decay)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with tempfile.TemporaryDirectory() as out:
        monitor = health.Monitor(cfg, accelerator, optimizer, tracking.Recorder(Path(out), accelerator),
                                 prec.effective, say=lambda text: None)
        step_wall, step_cpu, mon_wall, mon_cpu = [], [], [], []
        batches = iter(())
        for step in range(1, args.steps + 1):
            batch = next(batches, None)
            if batch is None:
                batches = iter(loader)
                batch = next(batches)
            w0, c0 = time.perf_counter(), time.process_time()
            with accelerator.autocast():
                loss = loss_fn(model(batch["inputs"]), batch["labels"])
            accelerator.backward(loss)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            w1, c1 = time.perf_counter(), time.process_time()
            monitor.check(loss, grad_norm)
            w2, c2 = time.perf_counter(), time.process_time()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            w3, c3 = time.perf_counter(), time.process_time()
            monitor.after_step(step)
            w4, c4 = time.perf_counter(), time.process_time()
            if step > 20:  # after warm-up
                mon_wall.append((w2 - w1) + (w4 - w3))
                mon_cpu.append((c2 - c1) + (c4 - c3))
                step_wall.append(w4 - w0)
                step_cpu.append(c4 - c0)
    med = statistics.median
    print(f"{prec.effective} on {accelerator.device} ({torch.get_num_threads()} threads), {len(step_wall)} steps timed, "
          f"batch {cfg.batch_size}")
    print(f"whole step:    wall {med(step_wall) * 1e6:8.1f} us   cpu {med(step_cpu) * 1e6:8.1f} us")
    print(f"health checks: wall {med(mon_wall) * 1e6:8.1f} us   cpu {med(mon_cpu) * 1e6:8.1f} us   "
          f"({med(mon_wall) / med(step_wall):.1%} of the step's wall time)")


if __name__ == "__main__":
    main()
