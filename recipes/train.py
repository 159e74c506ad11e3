#!/usr/bin/env python
"""Mixed-precision training with Accelerate: the lesson's loop, for real.

    accelerate launch recipes/train.py                          # the lesson's MLP, precision auto
    accelerate launch recipes/train.py --mixed_precision fp16   # autocast fp16 + GradScaler
    python recipes/train.py --config recipes/configs/mlp_lesson.yaml --num_epochs 3

The loop: forward under autocast, scaled backward, unscale and clip, step (skipped by the GradScaler
when gradients overflow), scheduler, zero_grad. Everything else (config, precision, data, models,
metrics, checkpoints, the run's record) lives in the `mixprec` package, one module per concern.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from mixprec import (checkpointing, config, data, distributed, faults, generate, health, metrics, models, optim,
                     precision, preemption, speed, tracking)
from mixprec.errors import UsageError, exit_on_usage_error


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy in fp32 for classes (B, C) or tokens (B, T, V)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction=reduction)


def evaluate(model, loader, accelerator, fp32: bool) -> dict:
    """Validation loss and accuracy: model.eval(), no_grad, and autocast off when fp32 (the default)."""
    model.eval()
    losses, hits = [], []
    with torch.no_grad(), precision.fp32_eval(model, accelerator, enabled=fp32):
        for batch in loader:
            logits, labels = model(batch["inputs"]), batch["labels"]
            loss = loss_fn(logits, labels, reduction="none").view(labels.shape)
            hit = (logits.argmax(-1) == labels).float()
            if labels.dim() > 1:  # tokens: average per sequence
                loss, hit = loss.mean(1), hit.mean(1)
            loss, hit = accelerator.gather_for_metrics((loss, hit))
            losses.append(loss)
            hits.append(hit)
    model.train()
    return {"val_loss": torch.cat(losses).mean().item(), "val_accuracy": torch.cat(hits).mean().item()}


@exit_on_usage_error
def main(argv: list[str] | None = None) -> dict:
    cfg = config.parse_config(argv, description=__doc__)
    accelerator, prec = precision.build_accelerator(cfg, **tracking.accelerator_kwargs(cfg))
    speed.check(cfg, accelerator.device)  # --tf32, --compile, --activation_checkpointing: possible here?
    echo = distributed.main_print(accelerator)  # once per run, not once per node
    out = Path(cfg.output_dir) if cfg.output_dir else checkpointing.default_output_dir(cfg)
    resume_path = checkpointing.open_run(cfg, out, accelerator)  # refuses to clobber another run
    preempt = preemption.Preemption(accelerator, out)  # SIGUSR1/SIGTERM: checkpoint, then exit for a requeue
    set_seed(cfg.seed)

    # data and model
    with accelerator.main_process_first():
        bundle = data.build(cfg)
    train_loader, val_loader = data.loaders(bundle, cfg, pin_memory=accelerator.device.type == "cuda")
    model = models.build(cfg.model, bundle.info, cfg.model_args)
    num_parameters = sum(p.numel() for p in model.parameters())  # before ZeRO-3 / FSDP shard them
    cost = metrics.training_cost(model, bundle.train[0]["inputs"], bundle.info)  # FLOPs per sample, for MFU
    speed_options = speed.apply(cfg, model, accelerator.device)  # compile, TF32, activation checkpointing
    faults.attach(model, next_step=lambda: step + 1)  # tests only: MIXPREC_FAULTS=nan_loss_at_step=N,...
    train_loader, val_loader = accelerator.prepare(train_loader, val_loader)
    batches_per_epoch = len(train_loader)
    if batches_per_epoch < cfg.gradient_accumulation_steps:
        raise UsageError(
            f"--gradient_accumulation_steps {cfg.gradient_accumulation_steps} is more than the {batches_per_epoch} "
            f"batches in an epoch (per process): lower it or --batch_size")
    steps_per_epoch = math.ceil(batches_per_epoch / cfg.gradient_accumulation_steps)
    total_steps = cfg.max_steps or cfg.num_epochs * steps_per_epoch
    num_epochs = math.ceil(total_steps / steps_per_epoch)

    # optimizer and schedule; the lesson's rule: a bigger global batch takes a proportionally bigger lr
    samples_per_step = cfg.batch_size * cfg.gradient_accumulation_steps * accelerator.num_processes
    lr = cfg.lr * samples_per_step / cfg.base_batch_size if cfg.scale_lr else cfg.lr
    optimizer = optim.adamw(model, lr, cfg.weight_decay, fused=speed_options["fused_adamw"])
    scheduler = optim.scheduler(optimizer, cfg.warmup_steps, total_steps, cfg.lr_schedule, cfg.min_lr_ratio,
                                accelerator.num_processes)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    distributed.match_input_dtype(accelerator, model)  # DeepSpeed bf16/fp16: the weights themselves are 16-bit

    # say what will run, and record it
    info = precision.describe(accelerator, prec, model, cfg.eval_precision)
    peak = metrics.peak_flops(accelerator.device, prec.effective, speed_options["tf32"], cfg.peak_flops)
    derived = {"output_dir": str(out), "lr": lr, "samples_per_step": samples_per_step, "total_steps": total_steps,
               "steps_per_epoch": steps_per_epoch, "num_epochs": num_epochs,
               "num_parameters": num_parameters,
               "train_samples": len(bundle.train), "val_samples": len(bundle.validation), **cost, **peak}
    echo(precision.banner(info, [metrics.describe_peak(cost, peak), speed.describe(speed_options)]))
    echo(f"training {cfg.model} on {cfg.dataset}: {derived['num_parameters']:,} parameters, "
                      f"{total_steps} steps of {samples_per_step} samples, lr {lr:g}, output {out}")
    state = checkpointing.TrainerState()
    if resume_path is not None:
        state = checkpointing.load(accelerator, resume_path)
        echo(f"resumed from {resume_path} at step {state.step} (epoch {state.epoch}, "
                          f"batch {state.batches_done})")
    run_info = {"config": config.to_dict(cfg), "effective": info, "derived": derived, "speed": speed_options,
                "resumed_from": str(resume_path or ""), "environment": tracking.environment()}
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        tracking.write_yaml(out / "config.yaml", run_info)
    recorder = tracking.Recorder(out, accelerator, cfg, run_info, resume_from=resume_path, state=state)

    # the loop
    fp32_eval = cfg.eval_precision == "fp32"
    max_norm = cfg.max_grad_norm or math.inf  # inf: measure the norm, clip nothing
    window_loss = torch.tensor(state.window_loss_sum, dtype=torch.float64, device=accelerator.device)
    window_batches, step, last_eval, last_save = state.window_batches, state.step, None, None
    throughput = metrics.Throughput(cost, peak, accelerator.num_processes, accelerator.device)
    started = time.perf_counter()
    progress = tqdm(total=total_steps, initial=step, desc="train", dynamic_ncols=True,
                    disable=not (accelerator.is_main_process and sys.stderr.isatty()))  # log files get the lines below
    say = progress.write if accelerator.is_main_process else (lambda text: None)
    monitor = health.Monitor(cfg, accelerator, optimizer, recorder, prec.effective, say, resumed=state.extra)
    last_loss = None
    model.train()
    for epoch in range(state.epoch, num_epochs):
        if step >= total_steps:
            break
        train_loader.set_epoch(epoch)  # a new, seeded shuffle each epoch
        batches, done = train_loader, 0
        if epoch == state.epoch and state.batches_done:  # resuming in the middle of this epoch
            batches, done = accelerator.skip_first_batches(train_loader, state.batches_done), state.batches_done
            batches.set_epoch(epoch)
        for batch in throughput.timed(batches):  # measures the wait for each batch
            with accelerator.accumulate(model):  # steps only every gradient_accumulation_steps batches
                with accelerator.autocast():
                    logits = model(batch["inputs"])
                    loss = loss_fn(logits, batch["labels"])
                accelerator.backward(loss)  # fp16: scaler.scale(loss).backward()
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)  # unscales first
                    monitor.check(loss, grad_norm)  # NaN/Inf: this step is skipped (or, --on_nan halt, the last)
                step_lr = optimizer.param_groups[0]["lr"]
                optimizer.step()  # fp16: skipped if gradients hold inf/NaN, then scaler.update()
                scheduler.step()  # does not advance on a skipped step
                optimizer.zero_grad(set_to_none=True)  # after the step: inside accumulate() this clears per window
            done += 1
            window_loss += loss.detach().double()
            window_batches += 1
            throughput.add(batch["labels"].shape[0] * accelerator.num_processes, step=accelerator.sync_gradients)
            if not accelerator.sync_gradients:
                continue

            step += 1
            state.skipped_steps += int(optimizer.step_was_skipped)
            monitor.after_step(step)  # health events and diagnoses; --on_nan halt stops here
            progress.update(1)
            faults.maybe_kill("kill_at_step", step)
            stop = preempt.requested(step)  # a signal reached any process: save now and leave
            if step % cfg.log_every == 0 or step == total_steps:
                mean_loss = accelerator.reduce(window_loss, "mean").item() / window_batches
                record = {"step": step, "epoch": round(epoch + done / batches_per_epoch, 4), "loss": mean_loss,
                          "lr": step_lr, "grad_norm": float(grad_norm), "skipped_steps": state.skipped_steps,
                          **throughput.report()}  # samples/s, tokens/s, step time, data wait, MFU, memory
                if accelerator.scaler is not None:
                    record["loss_scale"] = accelerator.scaler.get_scale()
                recorder.log(record)
                progress.set_postfix(loss=f"{mean_loss:.4f}", lr=f"{step_lr:.2e}",
                                     **({"scale": f"{record['loss_scale']:g}"} if "loss_scale" in record else {}))
                say(f"Epoch {epoch + 1}, Batch {done}, Loss: {mean_loss:.4f}")
                last_loss = mean_loss
                window_loss.zero_()
                window_batches = 0

            end_of_epoch = done == batches_per_epoch
            if end_of_epoch or step == total_steps or (cfg.eval_steps and step % cfg.eval_steps == 0):
                last_eval = {"step": step, "epoch": round(epoch + done / batches_per_epoch, 4),
                             **evaluate(model, val_loader, accelerator, fp32_eval)}
                recorder.log(last_eval)
                say(f"Epoch {epoch + 1}, step {step}: val_loss {last_eval['val_loss']:.4f}, "
                               f"val_accuracy {last_eval['val_accuracy']:.4f}")
                throughput.exclude_pause()
            if (cfg.checkpointing_steps and step % cfg.checkpointing_steps == 0) or step == total_steps or stop:
                state.step, state.epoch, state.batches_done = step, epoch, done
                if end_of_epoch:
                    state.epoch, state.batches_done = epoch + 1, 0
                state.window_loss_sum = accelerator.reduce(window_loss, "mean").item()  # every process resumes the mean
                state.window_batches = window_batches
                state.extra.update(recorder.checkpoint_state())
                state.extra.update(monitor.checkpoint_state())
                last_save = checkpointing.save(accelerator, out, state, cfg.checkpoints_total_limit)
                throughput.exclude_pause()
            if stop and step < total_steps:
                progress.close()
                preempt.leave(step, last_save)  # exits with preemption.EXIT_CODE (75)
            if step >= total_steps:
                break
    progress.close()

    # the end: final weights and a summary
    accelerator.wait_for_everyone()
    accelerator.save_model(model, str(out), safe_serialization=True)
    if last_eval is None:  # resumed a run that had already finished
        last_eval = evaluate(model, val_loader, accelerator, fp32_eval)
    generate.write_sample(model, bundle, cfg, accelerator, out, fp32_eval)  # language models: sample.txt
    summary = {"steps": step, "train_loss": last_loss, "val_loss": last_eval["val_loss"],
               "val_accuracy": last_eval["val_accuracy"], "skipped_steps": state.skipped_steps,
               "world_size": accelerator.num_processes, "effective_precision": prec.effective,
               "autocast_dtype": info["autocast_dtype"], "grad_scaler": accelerator.scaler is not None,
               "master_weight_dtype": info["master_weight_dtype"], "wall_time_s": time.perf_counter() - started,
               **throughput.summary(), **metrics.peak_memory(accelerator.device),
               "last_checkpoint": str(last_save or "")}
    recorder.finish(summary)
    if accelerator.is_main_process:
        echo(f"done: {step} steps in {summary['wall_time_s']:.1f}s, val_loss {summary['val_loss']:.4f}, "
                          f"val_accuracy {summary['val_accuracy']:.4f} ({prec.effective}); outputs in {out}")
        echo(metrics.describe_summary(summary))
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
