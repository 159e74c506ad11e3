#!/usr/bin/env python
"""The lesson's loop in Accelerate's idiom and nothing else: the minimal Accelerate loop the recipe is timed against.

The same model, data (the package's batches: the same order, whole accumulation windows), loss, optimizer,
schedule, clipping, precision and thread choice as recipes/train.py (it reads the same config and flags), and
the step as Accelerate's examples write it: `Accelerator(mixed_precision=..., gradient_accumulation_steps=...)`,
`accelerator.prepare(model, optimizer)`, then `accelerator.accumulate`, `accelerator.autocast`,
`accelerator.backward`, `accelerator.clip_grad_norm_`, `optimizer.step`, `scheduler.step`, `zero_grad`. The
precision is set up as the recipe's (`precision.choose` and `make_real`: fp16 on a CPU is real there too). Nothing
else runs: no evaluation, checkpoints, trackers, health checks or lost-update measurement, one host read per
log window. What the recipe costs beyond this loop is its own work (recipes/benchmark.py, runner `accelerate`).

    python benchmarks/baselines/accelerate_loop.py --mixed_precision bf16 --max_steps 600 --log_every 50 \\
        --output_dir runs/accelerate-loop

Writes metrics.jsonl (per window of --log_every steps: step, loss, step_time_s, samples_per_s, tokens_per_s
for text, loss_scale with fp16) and summary.json, as benchmarks/baselines/handwritten_loop.py does. One process.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

from mixprec.devices import threads

threads.quiet_waiting()  # as the recipe: before torch loads, idle OpenMP threads sleep instead of spinning

from accelerate import Accelerator  # noqa: E402

from mixprec import benchmarking, config, metrics, optim, precision  # noqa: E402
from mixprec.data.batches import Layout, TrainBatches  # noqa: E402
from mixprec.devices import hardware  # noqa: E402
from mixprec.errors import UsageError, exit_on_usage_error  # noqa: E402
from mixprec.evaluation import loss_fn  # noqa: E402
from mixprec.training import speed  # noqa: E402


@exit_on_usage_error
def main(argv: list[str] | None = None) -> dict:
    cfg = config.parse_config(argv, description=__doc__)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("the Accelerate loop runs in one process: launch it with python, not several processes")
    prec = precision.choose(cfg)
    if prec.effective not in ("no", "fp16", "bf16"):
        raise UsageError(f"--mixed_precision {prec.effective}: the Accelerate loop does fp32, fp16 and bf16 only")
    accelerator = Accelerator(mixed_precision=prec.effective, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                              step_scheduler_with_optimizer=False, kwargs_handlers=prec.kwargs_handlers,
                              **prec.launch_kwargs)
    precision.make_real(accelerator, prec)
    device = accelerator.device
    out = Path(cfg.output_dir or "runs/accelerate-loop")
    out.mkdir(parents=True, exist_ok=True)
    bundle, model, cost = benchmarking.baseline_model(cfg, device)  # seed, data, model, threads, speed options
    optimizer = optim.adamw(model, cfg.lr, cfg.weight_decay, fused=speed.fused_adamw(device))
    model, optimizer = accelerator.prepare(model, optimizer)
    accumulation = cfg.gradient_accumulation_steps
    batches = TrainBatches(bundle.train, Layout(cfg.batch_size, accumulation), cfg.seed, device, cfg.num_workers,
                           pin_memory=device.type == "cuda")
    total = cfg.max_steps or cfg.num_epochs * (len(batches) // accumulation)
    scheduler = optim.scheduler(optimizer, cfg.warmup_steps, total, cfg.lr_schedule, cfg.min_lr_ratio)
    max_norm = cfg.max_grad_norm or math.inf
    print(f"Accelerate loop: {cfg.model} on {cfg.dataset}, {device} ({hardware.device_name(device)}), precision "
          f"{prec.effective} ({prec.reason}), GradScaler {'on' if accelerator.scaler else 'off'}, {total} steps",
          flush=True)

    log = open(out / "metrics.jsonl", "w")
    stream = batches.forever()
    window_loss, window_steps, step, started = 0.0, 0, 0, time.perf_counter()
    window_start = time.perf_counter()
    model.train()
    while step < total:
        batch = next(stream)
        with accelerator.accumulate(model):
            with accelerator.autocast():
                loss = loss_fn(model(batch["inputs"]), batch["labels"])
            accelerator.backward(loss)
            window_loss += loss.detach() / accumulation if accumulation > 1 else loss.detach()
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), max_norm)
                optimizer.step()  # fp16: the GradScaler skips a step with inf/NaN
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step, window_steps = step + 1, window_steps + 1
                if step % cfg.log_every == 0 or step == total:
                    mean_loss = float(window_loss) / window_steps  # float(): waits for the device
                    benchmarking.log_window(log, step, mean_loss, window_steps, time.perf_counter() - window_start,
                                            accumulation * cfg.batch_size, cost["tokens_per_sample"],
                                            accelerator.scaler.get_scale() if accelerator.scaler else None)
                    window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
    log.close()
    return benchmarking.loop_summary(out, total, mean_loss, prec.effective, cfg.batch_size * accumulation,
                                     accelerator.scaler is not None, started, cost, metrics.peak_memory(device))


if __name__ == "__main__":
    main()
