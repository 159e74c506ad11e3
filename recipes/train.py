#!/usr/bin/env python
"""Mixed-precision training with Accelerate: the lesson's loop, for real.

    accelerate launch recipes/train.py                          # the lesson's MLP, precision auto
    accelerate launch recipes/train.py --mixed_precision fp16   # autocast fp16 + GradScaler
    python recipes/train.py --config recipes/configs/gpt_tiny.yaml --max_steps 100

The loop: forward under autocast, scaled backward, unscale and clip, step (not applied when the gradients
hold inf/NaN), schedule, zero_grad. Everything else (settings, precision, data, models, the run folder,
checkpoints, logging, health checks, the run's record) lives in the `mixprec` package, one module per concern.
"""
from __future__ import annotations

from mixprec import config, threads
from mixprec.compat.teardown import end_process
from mixprec.errors import exit_on_usage_error


@exit_on_usage_error
def main(argv: list[str] | None = None) -> dict:
    cfg = config.parse_config(argv, description=__doc__)  # --help and bad flags answer before torch loads
    threads.quiet_waiting()  # before torch loads: idle OpenMP threads sleep instead of spinning
    return train(cfg)


def train(cfg: config.TrainConfig) -> dict:
    from mixprec.evaluation import loss_fn
    from mixprec.training import start

    with start(cfg) as run:  # checks data, model and checkpoint before the run folder is touched; model.train()
        accelerator, model, optimizer, scheduler = run.accelerator, run.model, run.optimizer, run.scheduler
        for batch in run.batches():  # this process's share of each global batch, from where a resume left off
            with accelerator.accumulate(model):  # DDP syncs gradients on the last micro-batch of a window only
                with accelerator.autocast():
                    logits = model(batch["inputs"])
                    loss = loss_fn(logits, batch["labels"])  # in fp32
                accelerator.backward(loss)  # fp16: scaler.scale(loss).backward(); divided by the window's size
                run.add_loss(loss)  # for the log and the health checks; NaN in any micro-batch is seen
                if accelerator.sync_gradients:  # the window's last micro-batch: clip, step, schedule
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), run.max_grad_norm)  # unscales first
                    if run.health.allows_step(grad_norm):  # no: bf16/fp32 with inf/NaN gradients
                        optimizer.step()  # fp16: the GradScaler skips a step with inf/NaN, then updates the scale
                    scheduler.step()  # every step, skipped ones too: the schedule ends where the run ends
                    optimizer.zero_grad(set_to_none=True)
                    if run.step_end():  # log, evaluate, checkpoint; a signal: checkpoint and exit 75
                        break
        return run.finish()  # model.safetensors, sample.txt for language models, summary.json


if __name__ == "__main__":
    end_process(main)  # several processes: each ends without the interpreter's teardown (mixprec.compat.teardown)
