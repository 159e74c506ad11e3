#!/usr/bin/env python
"""Where the recipe's step spends its time beyond plain PyTorch, call by call, in one process.

    python benchmarks/loop_calls.py                                   # the default job (the MLP), fp32
    python benchmarks/loop_calls.py --mixed_precision bf16 --max_steps 3000 --output runs/loop-calls-bf16

Runs recipes/train.py's loop (through mixprec.training.prepared_run, in a run folder under --output) with a clock
around each call, and alternates its optimizer steps with the same step in plain PyTorch on the same model,
optimizer and schedule, as benchmarks/baselines/handwritten_loop.py writes it (torch.autocast, loss.backward, a GradScaler
for fp16, torch.nn.utils.clip_grad_norm_, the torch optimizer's step and zero_grad, the schedule's step, the
loss summed on the device): odd steps the recipe's, even steps plain, so that a slow spell of a shared machine
hits both sides. In bf16 and fp16 the plain step runs the model class's own forward (without the autocast
wrapper that accelerator.prepare puts on the model instance). Both sides take their batches from the
package's in-memory batches; the recipe's go through its throughput clock as in training. --max_steps counts
the recipe's steps (the run trains twice as many).

Prints the median and mean microseconds of each call per optimizer step on both sides and the difference,
and writes them with the machine line to <--output>/loop_calls.json (a new or empty folder). It takes
recipes/train.py's flags (config, precision, batch size ...) but not --output_dir or --resume_from_checkpoint;
one process only. It reports, it asserts nothing: timings on a shared machine swing, so compare the sides,
not runs on different days.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from mixprec import config
from mixprec.devices import threads
from mixprec.errors import UsageError, exit_on_usage_error

CALLS = ("batch", "accumulate", "autocast", "forward", "loss", "backward", "clip", "step decision",
         "optimizer.step", "scheduler.step", "zero_grad", "bookkeeping")
NOTES = {"accumulate": "recipe: accelerator.accumulate(model) and sync_gradients",
         "backward": "recipe: accelerator.backward; both divide the loss by the window's micro-batches when "
                     "there are several",
         "clip": "recipe: accelerator.clip_grad_norm_ (unscales first); plain: the scaler's unscale_ and torch's",
         "step decision": "recipe: run.health.allows_step (the health checks' one read); plain: none",
         "bookkeeping": "recipe: run.add_loss and run.step_end (health, throughput, log, evaluation, "
                        "checkpoints, signals); plain: the window's loss summed on the device"}


class Clock:
    """Laps between marks, summed per call within an optimizer step, kept per side and call."""

    def __init__(self):
        self.times, self.step = defaultdict(list), defaultdict(int)
        self.last = time.perf_counter_ns()

    def start(self) -> None:
        self.last = time.perf_counter_ns()

    def lap(self, call: str) -> None:
        now = time.perf_counter_ns()
        self.step[call] += now - self.last
        self.last = now

    def end_step(self, side: str) -> None:
        for call in CALLS:
            self.times[(side, call)].append(self.step.get(call, 0))
        self.times[(side, "step")].append(sum(self.step.values()))
        self.step.clear()


def forward_and_loss(autocast, model, batch, loss_fn, clock: Clock):
    """Enter `autocast` (the side's own), forward, loss, leave it: a lap after each, the same on both sides."""
    autocast.__enter__()
    clock.lap("autocast")
    logits = model(batch["inputs"])
    clock.lap("forward")
    loss = loss_fn(logits, batch["labels"])
    clock.lap("loss")
    autocast.__exit__(None, None, None)
    clock.lap("autocast")
    return loss


def recipe_step(run, batches, clock: Clock, loss_fn) -> bool:
    """recipes/train.py's loop body up to the end of one optimizer step, a lap after each call."""
    accelerator, model, optimizer, scheduler = run.accelerator, run.model, run.optimizer, run.scheduler
    clock.start()
    while True:
        batch = next(batches)
        clock.lap("batch")
        window = accelerator.accumulate(model)
        window.__enter__()
        clock.lap("accumulate")
        loss = forward_and_loss(accelerator.autocast(), model, batch, loss_fn, clock)
        accelerator.backward(loss)
        clock.lap("backward")
        run.add_loss(loss)
        clock.lap("bookkeeping")
        sync = accelerator.sync_gradients
        clock.lap("accumulate")
        if sync:
            break
        window.__exit__(None, None, None)
        clock.lap("accumulate")
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), run.max_grad_norm)
    clock.lap("clip")
    allowed = run.health.allows_step(grad_norm)
    clock.lap("step decision")
    if allowed:
        optimizer.step()
    clock.lap("optimizer.step")
    scheduler.step()
    clock.lap("scheduler.step")
    optimizer.zero_grad(set_to_none=True)
    clock.lap("zero_grad")
    done = run.step_end()
    clock.lap("bookkeeping")
    window.__exit__(None, None, None)
    clock.lap("accumulate")
    clock.end_step("recipe")
    return done


def plain_step(parts: dict, batches, clock: Clock, loss_fn) -> None:
    """benchmarks/baselines/handwritten_loop.py's step on the same model, optimizer and schedule, a lap after each call (its
    zero_grad at the end of the step, where the recipe has it, so that each side's backward starts from none)."""
    import torch

    model, optimizer, scheduler, scaler = parts["model"], parts["optimizer"], parts["scheduler"], parts["scaler"]
    accumulation, dtype, device = parts["accumulation"], parts["dtype"], parts["device"]
    clock.start()
    for _ in range(accumulation):
        batch = next(batches)
        clock.lap("batch")
        loss = forward_and_loss(torch.autocast(device, dtype=dtype, enabled=dtype is not None), model, batch,
                                loss_fn, clock)
        scaler.scale(loss / accumulation if accumulation > 1 else loss).backward()
        clock.lap("backward")
        parts["window_loss"] += loss.detach() / accumulation if accumulation > 1 else loss.detach()
        clock.lap("bookkeeping")
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), parts["max_norm"])
    clock.lap("clip")
    scaler.step(optimizer)
    scaler.update()
    clock.lap("optimizer.step")
    scheduler.step()
    clock.lap("scheduler.step")
    optimizer.zero_grad(set_to_none=True)  # at the end, as the recipe: the recipe's next backward finds no gradients
    clock.lap("zero_grad")
    clock.end_step("plain")


class GarbageCollections:
    """Time spent in Python's garbage collector during the loop, per generation (it runs inside whichever call
    allocates when a threshold is crossed, so it belongs to neither side)."""

    def __init__(self):
        self.seconds, self.count, self.began = defaultdict(float), defaultdict(int), 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.began = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self.began
            self.count[info["generation"]] += 1


def report(clock: Clock, steps: int, machine: str, gcs: GarbageCollections) -> dict:
    rows = []
    for call in (*CALLS, "step"):
        recipe, plain = clock.times[("recipe", call)], clock.times[("plain", call)]
        row = {"call": call, "note": NOTES.get(call, "")}
        for name, how in (("median", statistics.median), ("mean", statistics.fmean)):
            row[f"recipe_{name}_us"], row[f"plain_{name}_us"] = round(how(recipe) / 1e3, 1), round(how(plain) / 1e3, 1)
            row[f"difference_{name}_us"] = round((how(recipe) - how(plain)) / 1e3, 1)
        rows.append(row)
    collections = {f"generation {g}": {"collections": gcs.count[g], "seconds": round(gcs.seconds[g], 4),
                                       "us_per_step": round(gcs.seconds[g] / (2 * steps) * 1e6, 1)}
                   for g in sorted(gcs.count)}
    return {"machine": machine, "steps_per_side": steps, "rows": rows, "garbage_collections": collections,
            "how": "microseconds per optimizer step of each call (median and mean over the steps), recipe and "
                   "plain steps alternating; the mean includes what happens every N steps (logging, evaluation, "
                   "checkpoints, garbage collections)"}


def table(result: dict) -> str:
    lines = [f"{'call':16s} {'median: recipe':>15s} {'plain':>8s} {'difference':>11s}   "
             f"{'mean: recipe':>13s} {'plain':>8s} {'difference':>11s}   (microseconds per step)"]
    for r in result["rows"]:
        lines.append(f"{r['call']:16s} {r['recipe_median_us']:15.1f} {r['plain_median_us']:8.1f} "
                     f"{r['difference_median_us']:+11.1f}   {r['recipe_mean_us']:13.1f} {r['plain_mean_us']:8.1f} "
                     f"{r['difference_mean_us']:+11.1f}")
    lines.append("step: the median (mean) of whole steps, not the sum of the calls' medians")
    for generation, g in result["garbage_collections"].items():
        lines.append(f"garbage collections, {generation}: {g['collections']} in {g['seconds']:.3f} s "
                     f"({g['us_per_step']} us per step of either side)")
    return "\n".join(lines)


@exit_on_usage_error
def main(argv: list[str] | None = None) -> dict:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--output", default=None)
    args, rest = own.parse_known_args(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in rest):
        print(__doc__ + "\nThe training flags: python recipes/train.py --help")
        return {}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        raise UsageError("benchmarks/loop_calls.py runs in one process without DeepSpeed: launch it with python")
    for flag in ("--output_dir", "--resume_from_checkpoint"):
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            raise UsageError(f"{flag}: benchmarks/loop_calls.py trains a new run of its own under --output; "
                             f"leave {flag} out")
    out = Path(args.output or time.strftime("runs/loop-calls-%Y%m%d-%H%M%S"))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--output {out}: not an empty folder; name a new one")
    threads.quiet_waiting()  # as the recipe: before torch loads (parsing loads it for a transformers model)
    cfg = config.parse_config([*rest, "--output_dir", str(out / "run")])
    if cfg.resume_from_checkpoint:
        raise UsageError(f"resume_from_checkpoint {cfg.resume_from_checkpoint} (from --config): "
                         "benchmarks/loop_calls.py trains a new run of its own; leave it out")
    return measure(cfg, out)


def measure(cfg, out: Path) -> dict:
    import torch

    from mixprec import compat
    from mixprec.devices import hardware
    from mixprec.evaluation import loss_fn
    from mixprec.training import prepared_run

    clock, steps, gcs = Clock(), 0, GarbageCollections()
    with prepared_run(cfg) as run:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(run.prec.effective)
        scaler = run.accelerator.scaler or torch.amp.GradScaler(run.accelerator.device.type, enabled=False)
        parts = {"model": run.model, "optimizer": run.optimizer.optimizer,
                 "scheduler": getattr(run.scheduler, "scheduler", run.scheduler),
                 "scaler": scaler, "accumulation": cfg.gradient_accumulation_steps, "dtype": dtype,
                 "device": run.accelerator.device.type, "max_norm": run.max_grad_norm, "window_loss": 0.0}
        recipe_batches, plain_batches = run.batches(), run.train_batches.forever()
        done = False
        gc.callbacks.append(gcs)
        try:
            while not done:
                done = recipe_step(run, recipe_batches, clock, loss_fn)
                # With mixed precision `accelerator.prepare` put an autocast-and-fp32-outputs forward on the
                # model: the plain step runs the class's own forward (inside it, its own torch.autocast).
                with compat.autocast_off(run.model, run.accelerator, enabled=dtype is not None):
                    plain_step(parts, plain_batches, clock, loss_fn)
                steps += 1
        finally:
            gc.callbacks.remove(gcs)
        run.finish()
    result = report(clock, steps, hardware.machine_line(), gcs)
    (out / "loop_calls.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"wrote {out / 'loop_calls.json'}")
    return result


if __name__ == "__main__":
    main()
