#!/usr/bin/env python
"""A peer for recipes/benchmark.py: a plain Accelerate loop in the style of transformers'
examples/pytorch/language-modeling/run_clm_no_trainer.py, on the recipe's own transformers model.

The model, tokenizer and token blocks are the recipe's (mixprec.models.hf_flags and mixprec.data: the same
config, seed and initial weights; --config_name or --model_name_or_path, e.g.
recipes/configs/hf_gpt2_small.yaml); a built-in GPT config gets GPT-2 at its size, as the hf_trainer peer.
Then run_clm_no_trainer's loop: `Accelerator(mixed_precision=..., gradient_accumulation_steps=...)`, a
shuffled DataLoader with `default_data_collator`, AdamW with two parameter groups (no decay on biases and norm
weights: run_clm_no_trainer names them "bias" and "layer_norm.weight", which misses GPT-2's `ln_1` and Llama's
`input_layernorm`; here, as the recipe and the Trainer, every parameter of fewer than 2 dimensions), `get_scheduler`, `accelerator.prepare`, and per batch `with accelerator.accumulate(model)`:
`loss = model(**batch).loss`, `accelerator.backward(loss)`, `optimizer.step()`, `lr_scheduler.step()`,
`optimizer.zero_grad()`. Two changes make it do the recipe's work, no less: gradients clipped to
--max_grad_norm (`accelerator.clip_grad_norm_`, which run_clm_no_trainer does not do) and AdamW fused where the
recipe fuses it (run_clm_no_trainer leaves torch's default, a for-loop on a CPU: --accel_optim plain for that).
The model gets labels = inputs and shifts them itself (255 of 256 targets per block; the recipe: 256). As the
recipe, it builds no KV cache in training (`use_cache=False`, hf_trainer.hf_model).

    python benchmarks/peers/hf_accelerate.py --config recipes/configs/hf_gpt2_small.yaml --mixed_precision bf16 \\
        --max_steps 40 --log_every 10 --output_dir runs/hf_accelerate

Writes metrics.jsonl (per window of --log_every steps) and summary.json, as benchmarks/baselines/handwritten_loop.py does.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from mixprec.devices import threads

threads.quiet_waiting()  # as the recipe: before torch loads, idle OpenMP threads sleep instead of spinning

import torch  # noqa: E402

from mixprec import benchmarking, config, metrics, precision
from mixprec.devices import hardware
from mixprec.training import speed  # noqa: E402
from mixprec.data.batches import columns_of  # noqa: E402
from mixprec.errors import UsageError, exit_on_usage_error  # noqa: E402


def _sibling(name: str):
    """The peer module next to this file (benchmarks/peers is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_trainer_peer = _sibling("hf_trainer")
SCHEDULES, Blocks, hf_model = _trainer_peer.SCHEDULES, _trainer_peer.Blocks, _trainer_peer.hf_model


def peer_args(argv):
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--accel_optim", default="fused", choices=("fused", "plain"))
    parser.add_argument("--hf_attn", default="sdpa", choices=("sdpa", "eager"))
    parser.error = lambda message: (_ for _ in ()).throw(UsageError(message))
    return parser.parse_known_args(argv)


def optimizer_and_schedule(cfg, model, device, total: int, fused: bool):
    """run_clm_no_trainer's two AdamW groups (decayed, not decayed: biases and norm weights, told apart by their
    dimensions as the recipe does) and get_scheduler, with the recipe's lr, decay, warm-up and schedule."""
    from transformers import get_scheduler

    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, fused=fused and speed.fused_adamw(device) or None)
    extra = {"min_lr_rate": cfg.min_lr_ratio} if cfg.lr_schedule == "cosine" else None
    scheduler = get_scheduler(SCHEDULES[cfg.lr_schedule], optimizer=optimizer, num_warmup_steps=cfg.warmup_steps,
                              num_training_steps=total, scheduler_specific_kwargs=extra)
    return optimizer, scheduler


@exit_on_usage_error
def main(argv: list[str] | None = None) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import default_data_collator

    peer, rest = peer_args(sys.argv[1:] if argv is None else argv)
    cfg = config.parse_config(rest, description=__doc__)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or not cfg.max_steps:
        raise UsageError("the hf_accelerate peer runs in one process and needs --max_steps")
    device = torch.device(hardware.device_type())
    mp, why = precision.resolve(cfg.mixed_precision, device.type)
    if mp not in ("no", "bf16", "fp16"):
        raise UsageError(f"--mixed_precision {mp}: the hf_accelerate peer does fp32, bf16 or fp16 only")
    out = Path(cfg.output_dir or "runs/hf_accelerate")
    out.mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(mixed_precision=mp, gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                              cpu=device.type == "cpu")
    set_seed(cfg.seed)
    bundle, model, cost = hf_model(cfg, peer.hf_attn)
    if device.type == "cpu":  # the recipe's choice of threads (mixprec.devices.threads)
        hardware.set_cpu_threads(cfg.cpu_threads, cost["flops_per_sample"] * cfg.batch_size / 1e9)
    loader = torch.utils.data.DataLoader(Blocks(columns_of(bundle.train)["inputs"]), shuffle=True,
                                         collate_fn=default_data_collator, batch_size=cfg.batch_size,
                                         num_workers=cfg.num_workers)
    optimizer, scheduler = optimizer_and_schedule(cfg, model, device, cfg.max_steps, peer.accel_optim == "fused")
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    max_norm = cfg.max_grad_norm or math.inf
    print(f"hf_accelerate peer: {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters) "
          f"on {cfg.dataset}, {device} ({hardware.device_name(device)}), precision {mp} ({why}), AdamW "
          f"{'fused' if optimizer.optimizer.defaults.get('fused') else 'not fused'}, {cfg.max_steps} steps", flush=True)
    log = open(out / "metrics.jsonl", "w")
    samples_per_step = cfg.batch_size * cfg.gradient_accumulation_steps
    step, window_loss, window_steps, started = 0, 0.0, 0, time.perf_counter()
    window_start = time.perf_counter()
    model.train()
    while step < cfg.max_steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                window_loss += loss.detach() / cfg.gradient_accumulation_steps
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), max_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step, window_steps = step + 1, window_steps + 1
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                mean_loss = float(window_loss) / window_steps  # float(): waits for the device
                benchmarking.log_window(log, step, mean_loss, window_steps, time.perf_counter() - window_start,
                                        samples_per_step, cost["tokens_per_sample"], None)
                window_loss, window_steps, window_start = 0.0, 0, time.perf_counter()
            if step == cfg.max_steps:
                break
    log.close()
    return benchmarking.loop_summary(out, step, mean_loss, mp, samples_per_step, mp == "fp16", started, cost,
                                     metrics.peak_memory(device))


if __name__ == "__main__":
    main()
