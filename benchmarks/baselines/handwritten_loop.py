#!/usr/bin/env python
"""The lesson's loop by hand: plain PyTorch, torch.autocast and a GradScaler, no Accelerate.

The baseline that recipes/benchmark.py measures the recipe against: the same model, data (the package's
batches: the same order, whole accumulation windows), loss, optimizer, schedule, clipping, precision and speed
options as recipes/train.py (it reads the same config and flags, --model_name_or_path and --config_name
included: the same transformers model), in one process, with nothing else (no
evaluation, checkpoints, trackers or health checks). Its training step is plain PyTorch.

    python benchmarks/baselines/handwritten_loop.py --config recipes/configs/gpt_small.yaml --mixed_precision bf16 \\
        --max_steps 60 --log_every 10 --output_dir runs/handwritten

Writes metrics.jsonl (per window of --log_every steps: step, loss, step_time_s, samples_per_s, tokens_per_s
for text, loss_scale with fp16) and summary.json (final loss, peak memory, precision).
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

from mixprec.devices import threads

threads.quiet_waiting()  # as the recipe: before torch loads, idle OpenMP threads sleep instead of spinning

import torch  # noqa: E402

from mixprec import benchmarking, config, metrics, optim, precision
from mixprec.devices import hardware
from mixprec.training import speed
from mixprec.data.batches import Layout, TrainBatches
from mixprec.errors import UsageError, exit_on_usage_error
from mixprec.evaluation import loss_fn

DTYPES = {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@exit_on_usage_error
def main(argv: list[str] | None = None) -> dict:
    cfg = config.parse_config(argv, description=__doc__)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("the hand-written loop runs in one process: launch it with python, not several processes")
    device = torch.device(hardware.device_type())
    mp, why = precision.resolve(cfg.mixed_precision, device.type)
    if mp not in DTYPES:
        raise UsageError(f"--mixed_precision {mp}: the hand-written loop does autocast fp16/bf16 or fp32 only")
    out = Path(cfg.output_dir or "runs/handwritten")
    out.mkdir(parents=True, exist_ok=True)
    bundle, model, cost = benchmarking.baseline_model(cfg, device)  # seed, data, model, threads, speed options
    model.to(device)
    optimizer = optim.adamw(model, cfg.lr, cfg.weight_decay, fused=speed.fused_adamw(device))
    batches = TrainBatches(bundle.train, Layout(cfg.batch_size, cfg.gradient_accumulation_steps), cfg.seed, device,
                           cfg.num_workers, pin_memory=device.type == "cuda")
    total = cfg.max_steps or cfg.num_epochs * (len(batches) // cfg.gradient_accumulation_steps)
    scheduler = optim.scheduler(optimizer, cfg.warmup_steps, total, cfg.lr_schedule, cfg.min_lr_ratio)
    scaler = torch.amp.GradScaler(device.type, enabled=mp == "fp16", init_scale=cfg.init_scale,
                                  growth_interval=cfg.growth_interval)
    max_norm = cfg.max_grad_norm or math.inf
    print(f"hand-written loop: {cfg.model} on {cfg.dataset}, {device} ({hardware.device_name(device)}), "
          f"precision {mp} ({why}), GradScaler {'on' if scaler.is_enabled() else 'off'}, {total} steps", flush=True)

    log = open(out / "metrics.jsonl", "w")
    accumulation = cfg.gradient_accumulation_steps
    stream = batches.forever()
    window_loss, window_steps, started = 0.0, 0, time.perf_counter()
    window_start = time.perf_counter()
    model.train()
    for step in range(1, total + 1):
        optimizer.zero_grad(set_to_none=True)
        for _ in range(accumulation):  # gradient accumulation: the loss of each micro-batch divided by their number
            batch = next(stream)
            with torch.autocast(device.type, dtype=DTYPES[mp], enabled=DTYPES[mp] is not None):
                logits = model(batch["inputs"])
                loss = loss_fn(logits, batch["labels"])
            scaler.scale(loss / accumulation if accumulation > 1 else loss).backward()  # as the recipe: no x / 1
            window_loss += loss.detach() / accumulation if accumulation > 1 else loss.detach()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)  # skipped if the gradients hold inf/NaN
        scaler.update()
        scheduler.step()  # every step, skipped ones too
        window_steps += 1
        if step % cfg.log_every == 0 or step == total:
            mean_loss = float(window_loss) / window_steps  # float(): waits for the device
            benchmarking.log_window(log, step, mean_loss, window_steps, time.perf_counter() - window_start,
                                    accumulation * cfg.batch_size, cost["tokens_per_sample"],
                                    scaler.get_scale() if scaler.is_enabled() else None)
            window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
    log.close()
    summary = benchmarking.loop_summary(out, total, mean_loss, mp, cfg.batch_size * accumulation,
                                        scaler.is_enabled(), started, cost, metrics.peak_memory(device))
    return summary


if __name__ == "__main__":
    main()
