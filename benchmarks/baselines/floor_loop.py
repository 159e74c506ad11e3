#!/usr/bin/env python
"""The floor: the least a training step can cost, nanoGPT-style, for recipes/benchmark.py.

The training rows are tensors in memory, taken from the dataset once; each micro-batch is a seeded random
index into them (no DataLoader, no epochs, no collation). Then the same step as the recipe: forward under
autocast, the package's loss (mixprec.evaluation.loss_fn), backward (a GradScaler for fp16), clip, AdamW
(mixprec.optim.adamw, fused where the recipe fuses it), the recipe's LambdaLR (mixprec.optim.lr_factor).
Nothing else runs: no evaluation, checkpoints, trackers or health checks, one host sync per log window.
It reads the same --config and flags as recipes/train.py; it uses model (or a transformers model:
model_name_or_path or config_name, tokenizer_name, block_size), model_args, dataset,
dataset_args, mixed_precision, batch_size, gradient_accumulation_steps, lr, weight_decay, warmup_steps,
lr_schedule, min_lr_ratio, max_steps (or num_epochs), max_grad_norm, seed, init_scale, growth_interval,
compile, tf32, activation_checkpointing, cpu_threads, log_every and output_dir, and ignores the rest.

    python benchmarks/baselines/floor_loop.py --config recipes/configs/gpt_small.yaml --mixed_precision bf16 \\
        --max_steps 60 --log_every 10 --output_dir runs/floor

Writes metrics.jsonl (per window of --log_every steps: step, loss, step_time_s, samples_per_s, tokens_per_s
for text, loss_scale with fp16) and summary.json, as benchmarks/baselines/handwritten_loop.py does.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

from mixprec.devices import threads

threads.quiet_waiting()  # as the recipe: before torch loads, idle OpenMP threads sleep instead of spinning

import torch  # noqa: E402

from mixprec import benchmarking, config, data, metrics, models, optim, precision
from mixprec.devices import hardware
from mixprec.training import speed
from mixprec.data.batches import columns_of
from mixprec.errors import UsageError, exit_on_usage_error
from mixprec.evaluation import loss_fn

DTYPES = {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def setup(cfg: config.TrainConfig):
    """Device, precision, the training columns as tensors on the device, model, optimizer, schedule, scaler."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("the floor loop runs in one process: launch it with python, not several processes")
    device = torch.device(hardware.device_type())
    mp, why = precision.resolve(cfg.mixed_precision, device.type)
    if mp not in DTYPES:
        raise UsageError(f"--mixed_precision {mp}: the floor loop does autocast fp16/bf16 or fp32 only")
    torch.manual_seed(cfg.seed)
    bundle = data.build(cfg)
    columns = {k: v.to(device, torch.int64 if not v.is_floating_point() else v.dtype)
               for k, v in columns_of(bundle.train).items()}
    model = models.build(cfg.model, bundle.info, cfg.model_args)
    cost = metrics.training_cost(model, columns["inputs"][0], bundle.info)
    if device.type == "cpu":  # the recipe's choice of threads (mixprec.devices.threads)
        hardware.set_cpu_threads(cfg.cpu_threads, cost["flops_per_sample"] * cfg.batch_size / 1e9)
    speed.apply(cfg.speed, cfg, model, device)  # --compile, --tf32, --activation_checkpointing as in the recipe
    model.to(device).train()
    optimizer = optim.adamw(model, cfg.lr, cfg.weight_decay, fused=speed.fused_adamw(device))
    rows = len(columns["inputs"])
    total = cfg.max_steps or cfg.num_epochs * (rows // (cfg.batch_size * cfg.gradient_accumulation_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: optim.lr_factor(s, cfg.warmup_steps, total, cfg.lr_schedule, cfg.min_lr_ratio))
    scaler = torch.amp.GradScaler(device.type, enabled=mp == "fp16", init_scale=cfg.init_scale,
                                  growth_interval=cfg.growth_interval)
    print(f"floor loop: {cfg.model} on {cfg.dataset} ({rows:,} rows in memory), {device} "
          f"({hardware.device_name(device)}), precision {mp} ({why}), "
          f"GradScaler {'on' if scaler.is_enabled() else 'off'}, {total} steps", flush=True)
    return device, mp, columns, model, optimizer, scheduler, scaler, cost, total


@exit_on_usage_error
def main(argv: list[str] | None = None) -> dict:
    cfg = config.parse_config(argv, description=__doc__)
    device, mp, columns, model, optimizer, scheduler, scaler, cost, total = setup(cfg)
    out = Path(cfg.output_dir or "runs/floor")
    out.mkdir(parents=True, exist_ok=True)
    inputs, labels, rows = columns["inputs"], columns["labels"], len(columns["inputs"])
    generator = torch.Generator().manual_seed(cfg.seed)
    accumulation, max_norm, dtype = cfg.gradient_accumulation_steps, cfg.max_grad_norm or math.inf, DTYPES[mp]
    log = open(out / "metrics.jsonl", "w")
    window_loss, window_steps, started = 0.0, 0, time.perf_counter()
    window_start = started
    for step in range(1, total + 1):
        for _ in range(accumulation):
            ix = torch.randint(rows, (cfg.batch_size,), generator=generator).to(device)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = loss_fn(model(inputs[ix]), labels[ix])
            scaler.scale(loss / accumulation if accumulation > 1 else loss).backward()  # as the recipe: no x / 1
            window_loss += loss.detach() / accumulation if accumulation > 1 else loss.detach()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
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
