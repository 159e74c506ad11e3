#!/usr/bin/env python
"""Checkpoint and resume with Accelerate: `save_state` every N steps, `load_state` to continue exactly.

    accelerate launch --config_file accelerate_configs/multi_cpu.yaml recipes/standalone/resume.py \
        --checkpointing_steps 50 --output_dir runs/resume
    # killed, preempted, out of time? The same command with:  --resume_from_checkpoint latest

One file, torch and accelerate only. The lesson's MLP (as in mlp.py) with a warmup + cosine learning rate, on
any number of processes. A resumed run continues as if it had never stopped: the same weights, Adam moments,
learning rate, data position and random state, so its losses are bitwise those of an uninterrupted run
(tests/test_standalone_mlp.py checks this, and that the curve is recipes/train.py's for the same flags).
Resume with the same flags and number of processes: the data position is computed from the step for this
layout (recipes/train.py also resumes on another split of the same global batch).
Each optimizer step's loss goes to OUTPUT_DIR/metrics.jsonl, one JSON object a line.
"""
import argparse
import json
import math
import os
import shutil

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mixed_precision", choices=["no", "bf16", "fp16"], default="no")
    p.add_argument("--batch_size", type=int, default=32, help="rows per micro-batch on each process")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup_steps", type=int, default=20, help="linear warmup, then cosine decay")
    p.add_argument("--min_lr_ratio", type=float, default=0.1, help="the final lr, as a fraction of --lr")
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--num_epochs", type=int, default=10)
    p.add_argument("--max_steps", type=int, default=0, help="optimizer steps (0: --num_epochs epochs)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log_every", type=int, default=50, help="print the loss every N steps")
    p.add_argument("--checkpointing_steps", type=int, default=100, help="save a checkpoint every N steps")
    p.add_argument("--resume_from_checkpoint", default=None, help="a checkpoint folder, or 'latest' in --output_dir")
    p.add_argument("--output_dir", default="runs/standalone-resume")
    args = p.parse_args(argv)
    if args.mixed_precision == "fp16" and not torch.cuda.is_available():
        p.error("fp16 on a CPU: Accelerate alone would train in fp32 here without a word; recipes/standalone/mlp.py "
                "shows fp16 made real on a CPU. Use --mixed_precision bf16 or no")
    return args


def lesson_data(seed: int, num_samples: int = 500):
    """The lesson's training data (mlp.py says more): randn inputs, random labels, from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_samples + 100, 100, generator=gen)
    labels = torch.randint(0, 10, (num_samples + 100,), generator=gen)
    return inputs[:num_samples], labels[:num_samples]


def batches_of_epoch(rows: int, args, rank: int, world: int, epoch: int):
    """This process's row indices for each micro-batch of `epoch` (mlp.py explains the split). The order is a
    function of (seed, epoch) alone: a resumed run finds its data position from the step number, with nothing
    to save for it."""
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(args.seed * 1_000_003 + epoch))
    per_epoch = rows // (args.batch_size * world) // args.gradient_accumulation_steps * args.gradient_accumulation_steps
    for i in range(per_epoch):
        first = (i * world + rank) * args.batch_size
        yield order[first:first + args.batch_size]


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of --lr for optimizer step `step` (0-based): linear warmup, then cosine decay to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    if total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def save_checkpoint(accelerator, output_dir: str, step: int) -> None:
    """`save_state` writes the model, the optimizer, the scheduler (all three prepared) and each process's random
    states (random_states_<rank>.pkl). Written into a temporary folder, then renamed: a run
    killed while saving leaves no half-written step_N for `latest` to pick."""
    final = os.path.join(output_dir, "checkpoints", f"step_{step}")
    tmp = os.path.join(output_dir, "checkpoints", f".tmp-step_{step}")
    accelerator.save_state(tmp)  # every process calls it: each writes its own random state
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    accelerator.wait_for_everyone()


def setup(args, rows: int):
    """The Accelerator, and the model, optimizer and schedule, prepared; the run's length in steps."""
    accelerator = Accelerator(mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps,
                              # the prepared scheduler steps once per call (by default: once per process, and
                              # not after a skipped step, for schedules counted in one process's batches)
                              step_scheduler_with_optimizer=False,
                              cpu=not torch.cuda.is_available())  # no GPU: CPU processes in a gloo group
    set_seed(args.seed)  # the same initial weights on every process
    model = torch.nn.Sequential(torch.nn.Linear(100, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 10))
    params = list(model.parameters())  # AdamW, weight decay on the matrices only (mlp.py)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, fused=accelerator.device.type in ("cpu", "cuda"))
    micro_batches = len(list(batches_of_epoch(rows, args, 0, accelerator.num_processes, 0)))
    steps_per_epoch = micro_batches // args.gradient_accumulation_steps
    total_steps = args.max_steps or args.num_epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, args.warmup_steps, total_steps, args.min_lr_ratio))
    # What is prepared, save_state saves and load_state restores; anything else with state_dict() and
    # load_state_dict() joins them with accelerator.register_for_checkpointing(obj).
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    set_seed(args.seed + accelerator.process_index)  # from here on each process draws its own random numbers
    return accelerator, model, optimizer, scheduler, steps_per_epoch, total_steps


def resume(accelerator, args) -> int:
    """Load the checkpoint asked for, if any; the step it was taken at (0: a fresh start)."""
    path, root = args.resume_from_checkpoint, os.path.join(args.output_dir, "checkpoints")
    if path == "latest":  # the highest step_N: a half-written checkpoint is still named .tmp-step_N
        steps = [int(name[5:]) for name in os.listdir(root) if name.startswith("step_")] if os.path.isdir(root) else []
        path = os.path.join(root, f"step_{max(steps)}") if steps else None
        if path is None:
            accelerator.print(f"no checkpoint in {root}: starting from step 0")
    if not path:
        return 0
    # the model, the optimizer (Adam's moments and step counts), the scheduler, and this process's random states
    accelerator.load_state(path)
    step = int(os.path.basename(os.path.normpath(path))[5:])  # the step is in the folder's name: step_N
    accelerator.print(f"resumed from {path} at step {step}")
    return step


def open_log(accelerator, args, step: int):
    """metrics.jsonl, with the records up to the checkpoint's step (a killed run may have written later ones,
    which the resumed run trains again and writes anew). None on the processes other than the main one."""
    if not accelerator.is_main_process:
        return None
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, "metrics.jsonl")
    kept = [line for line in open(path) if json.loads(line)["step"] <= step] if step and os.path.exists(path) else []
    log = open(path, "w")
    log.writelines(kept)
    return log


def main(argv=None):
    args = parse_args(argv)
    train_x, train_y = lesson_data(args.seed)
    accelerator, model, optimizer, scheduler, steps_per_epoch, total_steps = setup(args, len(train_x))
    rank, world, accumulation = accelerator.process_index, accelerator.num_processes, args.gradient_accumulation_steps
    step = resume(accelerator, args)
    log = open_log(accelerator, args, step)
    # The data position: `step` steps done = whole epochs, then some micro-batches of the next one.
    epoch, skip = step // steps_per_epoch, step % steps_per_epoch * accumulation
    step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    while step < total_steps:
        for i, index in enumerate(batches_of_epoch(len(train_x), args, rank, world, epoch)):
            if i < skip:  # micro-batches the checkpoint's run had already trained on
                continue
            with accelerator.accumulate(model):  # as in mlp.py: autocast, backward, clip, step
                with accelerator.autocast():
                    loss = F.cross_entropy(model(train_x[index].to(accelerator.device)).float(),
                                           train_y[index].to(accelerator.device))
                accelerator.backward(loss)
                step_loss += loss.detach()
                if not accelerator.sync_gradients:
                    continue
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                lr = optimizer.param_groups[0]["lr"]  # this step's
                if accelerator.scaler is not None or torch.isfinite(grad_norm):  # bf16/fp32: no step with inf/NaN
                    optimizer.step()
                scheduler.step()  # once per optimizer step, on every process
                optimizer.zero_grad(set_to_none=True)
                step += 1
                # the step's loss: the mean over its micro-batches and over the processes (as in mlp.py)
                loss_value = accelerator.reduce(step_loss, "mean").float().item() / accumulation
                step_loss.zero_()
                # one draw from each process's torch generator, as dropout would make: a resumed run draws the same
                draws = accelerator.gather(torch.rand(1, device=accelerator.device)).tolist()
                if log is not None:
                    log.write(json.dumps({"step": step, "loss": loss_value, "lr": lr,
                                          "grad_norm": grad_norm.item(), "random": draws}) + "\n")
                    log.flush()
                if step % args.log_every == 0 or step == total_steps:
                    accelerator.print(f"Epoch {epoch + 1}, step {step}, Loss: {loss_value:.4f}")
                if step % args.checkpointing_steps == 0 or step == total_steps:
                    save_checkpoint(accelerator, args.output_dir, step)
                if step == total_steps:
                    break
        epoch, skip = epoch + 1, 0
    if log is not None:
        log.close()
    # Free the DDP wrapper before its process group: freed after it (when main returns), its Reducer ends gloo's
    # group holding the GIL and the process can hang at exit (torch 2.13; mixprec/compat/teardown.py says why)
    model = None
    accelerator.free_memory()  # drops Accelerate's references to the prepared objects
    accelerator.end_training()


if __name__ == "__main__":
    main()
