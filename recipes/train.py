#!/usr/bin/env python
"""Mixed-precision training with Accelerate: the lesson's loop, for real.

    accelerate launch recipes/train.py                          # the lesson's MLP, precision auto
    accelerate launch recipes/train.py --mixed_precision fp16   # autocast fp16 + GradScaler
    python recipes/train.py --config recipes/configs/gpt_tiny.yaml --max_steps 100

Accelerate's idiom as in its examples: `Accelerator(mixed_precision=...)`, `accelerator.prepare`, then the loop:
forward under autocast, scaled backward, unscale and clip, step (not applied when the gradients hold inf/NaN),
schedule, zero_grad. What the package adds is called by name: `precision.choose` / `make_real` (auto, fp16 on a
CPU, DeepSpeed's config), `training.start` (every check before the run folder is touched, resume), `start.begin`
and the `run`'s bookkeeping (logging, evaluation, checkpoints, signals, health checks, the run's record).
recipes/standalone/ holds single-file recipes without the package, each tested against this one.

The loss of an optimizer step is token-weighted: the sum of the per-token (per-row) losses over all targets of
its micro-batches, on all processes, divided by their count. Where every micro-batch holds as many targets
(tables, images, text blocks) that is the mean of the micro-batches' means, as written. Chat data masks the
prompt (label -100), so micro-batches differ: each carries `targets`, the step's target count over (micro-batches
x processes), and its summed loss is divided by that; Accelerate's division by the accumulation steps and DDP's
mean over processes then leave sum / count, whatever the split (mixprec.data.batches).
"""
from __future__ import annotations

from mixprec import config
from mixprec.devices import threads
from mixprec.errors import exit_on_usage_error
from mixprec.process_end import end_process


@exit_on_usage_error
def main(argv: list[str] | None = None) -> dict:
    threads.quiet_waiting()  # before torch loads: idle OpenMP threads sleep instead of spinning
    cfg = config.parse_config(argv, description=__doc__)  # --help and bad flags answer before torch loads
    return train(cfg)


def train(cfg: config.TrainConfig) -> dict:
    from accelerate import Accelerator

    from mixprec import precision, tracking, training
    from mixprec.evaluation import loss_fn

    prec = precision.choose(cfg)  # --mixed_precision here (auto: bf16 where native), or a one-line error
    accelerator = Accelerator(
        mixed_precision=prec.effective,  # "no", "fp16" (autocast + GradScaler), "bf16" (autocast) or "fp8"
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        step_scheduler_with_optimizer=False,  # the schedule steps below, once per optimizer step
        kwargs_handlers=prec.kwargs_handlers,  # GradScalerKwargs(--init_scale, --growth_interval); fp8's
        **prec.launch_kwargs, **tracking.accelerator_kwargs(cfg.tracking))  # cpu=, DeepSpeed's plugin; --report_to
    precision.make_real(accelerator, prec)  # fp16 on a CPU (Accelerate alone: fp32); Accelerate's choice checked
    with training.start(cfg, accelerator, prec) as start:  # checks data, model, checkpoint; opens the run folder
        if start.finished:  # a resume of a finished run: nothing to train, nothing written
            return start.finish()
        model, optimizer = accelerator.prepare(start.model, start.optimizer)  # DDP or DeepSpeed; autocast forward
        run = start.begin(model, optimizer)  # resume: accelerator.load_state; the banner; config.yaml; model.train()
        scheduler = run.scheduler  # torch's LambdaLR, saved with each checkpoint (register_for_checkpointing)
        for batch in run.batches():  # this process's share of each global batch, from where a resume left off
            with accelerator.accumulate(model):  # DDP syncs gradients on the last micro-batch of a window only
                with accelerator.autocast():
                    loss = loss_fn(model(batch["inputs"]), batch["labels"], batch.get("targets"))  # chat: sum/targets
                accelerator.backward(loss)  # fp16: scaler.scale(loss).backward(); /accumulation, then DDP's mean
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
    end_process(main)  # ends without the interpreter's teardown, once its exit functions ran (mixprec.process_end)
