#!/usr/bin/env python
"""The lesson's MLP with Accelerate's mixed precision: fp32, bf16 (autocast) or fp16 (autocast + GradScaler).

    accelerate launch recipes/standalone/mlp.py --mixed_precision bf16
    accelerate launch --config_file accelerate_configs/multi_cpu.yaml recipes/standalone/mlp.py --mixed_precision fp16

One file, torch and accelerate only: copy it out and it runs. It trains what `recipes/train.py --config
recipes/configs/mlp_lesson.yaml` trains, step for step and bit for bit (tests/test_standalone_mlp.py compares the
two loss curves), without the full recipe's checks, run folder, checkpoints and health checks.
Each optimizer step's loss goes to OUTPUT_DIR/metrics.jsonl, one JSON object a line.
"""
import argparse
import json
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no")
    p.add_argument("--batch_size", type=int, default=32, help="rows per micro-batch on each process")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--num_epochs", type=int, default=10)
    p.add_argument("--max_steps", type=int, default=0, help="optimizer steps (0: --num_epochs epochs)")
    p.add_argument("--init_scale", type=float, default=65536.0, help="fp16: the GradScaler's first loss scale")
    p.add_argument("--growth_interval", type=int, default=2000, help="fp16: good steps before the scale doubles")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--log_every", type=int, default=50, help="print the loss every N steps")
    p.add_argument("--output_dir", default="runs/standalone-mlp")
    return p.parse_args(argv)


def lesson_data(seed: int, num_samples: int = 500, num_val: int = 100):
    """The lesson's data: randn inputs and random labels (10 classes), from one seeded generator; the first 500
    rows train, the next 100 are held out. Nothing to learn: the training loss falls as the MLP memorises."""
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(num_samples + num_val, 100, generator=gen)
    labels = torch.randint(0, 10, (num_samples + num_val,), generator=gen)
    return (inputs[:num_samples], labels[:num_samples]), (inputs[num_samples:], labels[num_samples:])


def batches_of_epoch(rows: int, args, rank: int, world: int, epoch: int):
    """This process's row indices for each micro-batch of `epoch`. One permutation of the rows per epoch, seeded
    by (seed, epoch) and the same on every process, is cut into global micro-batches of batch_size x world rows;
    process r takes rows [r*b, (r+1)*b) of each. Rows that do not fill a whole optimizer step are left out.
    (Why not `accelerator.prepare(DataLoader(...))`? Its split is another order: process r takes whole batches
    r, r+world, ... The full recipe slices each global batch, so that a checkpoint's data position means the
    same rows on any number of processes; indexing tensors in memory is also what it does for data this small.)"""
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(args.seed * 1_000_003 + epoch))
    per_epoch = rows // (args.batch_size * world) // args.gradient_accumulation_steps * args.gradient_accumulation_steps
    for i in range(per_epoch):
        first = (i * world + rank) * args.batch_size
        yield order[first:first + args.batch_size]


def setup(args):
    """The Accelerator, fp16 made real where Accelerate leaves it out, the model and its optimizer, prepared."""
    # mixed_precision: "bf16" runs the forward under bf16 autocast (weights stay fp32); "fp16" under fp16 autocast
    # with a GradScaler; "no" in fp32. cpu=True without a GPU: several CPU processes form a gloo group.
    accelerator = Accelerator(mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps,
                              cpu=not torch.cuda.is_available())
    # fp16 needs an fp16 autocast and a GradScaler. On a GPU Accelerate makes both (`accelerator.autocast()`,
    # `accelerator.scaler`). On a CPU (accelerate 1.16) it makes neither, and "fp16" would train in fp32 without a
    # word. So there this recipe makes fp16 real itself, with torch's own autocast and CPU GradScaler.
    scaler = accelerator.scaler
    own_fp16 = args.mixed_precision == "fp16" and scaler is None
    if own_fp16:
        scaler = torch.amp.GradScaler(accelerator.device.type, init_scale=args.init_scale,
                                      growth_interval=args.growth_interval)
    set_seed(args.seed)  # before the model is built: the same initial weights on every process
    model = torch.nn.Sequential(torch.nn.Linear(100, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, 10))
    # AdamW, weight decay on the matrices only (not on biases), as nanoGPT and the full recipe do; fused: one
    # kernel for the whole update (CPU and CUDA).
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    raw_optimizer = torch.optim.AdamW(groups, lr=args.lr, fused=accelerator.device.type in ("cpu", "cuda"))
    # prepare: the model on the device, in DDP with several processes (gradients averaged over processes), its
    # forward under autocast for bf16 (and GPU fp16); the optimizer wrapped to step only at the end of an
    # accumulation window. The learning rate is constant (the lesson's): no scheduler.
    model, optimizer = accelerator.prepare(model, raw_optimizer)
    made = " (fp16 autocast and GradScaler made by this recipe)" if own_fp16 else ""
    accelerator.print(f"{accelerator.num_processes} process(es) on {accelerator.device}, {args.mixed_precision}{made}")
    return accelerator, model, optimizer, raw_optimizer, scaler, own_fp16


def evaluate(accelerator, model, val_x, val_y) -> dict:
    """Loss and accuracy on the held-out rows, in fp32: the model without the autocast prepare wrapped around it."""
    net = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    with torch.no_grad():
        logits = net(val_x.to(accelerator.device)).cpu()
    return {"val_loss": F.cross_entropy(logits, val_y).item(),
            "val_accuracy": (logits.argmax(-1) == val_y).float().mean().item()}


def main(argv=None):
    args = parse_args(argv)
    accelerator, model, optimizer, raw_optimizer, scaler, own_fp16 = setup(args)
    autocast = (lambda: torch.autocast(accelerator.device.type, torch.float16)) if own_fp16 else accelerator.autocast
    (train_x, train_y), (val_x, val_y) = lesson_data(args.seed)  # its own generator: no global random state used
    rank, world, accumulation = accelerator.process_index, accelerator.num_processes, args.gradient_accumulation_steps
    steps_per_epoch = len(list(batches_of_epoch(len(train_x), args, rank, world, 0))) // accumulation
    total_steps = args.max_steps or args.num_epochs * steps_per_epoch
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        log = open(os.path.join(args.output_dir, "metrics.jsonl"), "w")

    step, epoch = 0, 0
    step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)  # summed in float64
    while step < total_steps:
        for index in batches_of_epoch(len(train_x), args, rank, world, epoch):
            inputs, labels = train_x[index].to(accelerator.device), train_y[index].to(accelerator.device)
            with accelerator.accumulate(model):  # DDP: gradients are synced on a window's last micro-batch only
                with autocast():  # matmuls in fp16/bf16; weights, gradients and the optimizer stay fp32
                    logits = model(inputs)
                    loss = F.cross_entropy(logits.float(), labels)  # the softmax and the loss in fp32
                if own_fp16:  # what accelerator.backward does with a GradScaler: multiply the loss by the scale,
                    scaler.scale(loss / accumulation).backward()  # so that small fp16 gradients do not flush to 0
                else:  # divides the loss by the window's size (GPU fp16: and scales it)
                    accelerator.backward(loss)
                step_loss += loss.detach()
                if not accelerator.sync_gradients:  # not yet the window's last micro-batch
                    continue
                if own_fp16:  # divide the gradients by the scale before clipping, noting any inf/NaN
                    scaler.unscale_(raw_optimizer)  # (accelerator.clip_grad_norm_ does this itself on a GPU)
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                if own_fp16:
                    scaler.step(raw_optimizer)  # skips the step if unscale_ found inf/NaN in a gradient
                    scaler.update()  # after a skip: scale / 2; after growth_interval good steps in a row: x 2
                elif scaler is not None or torch.isfinite(grad_norm):  # GPU fp16: the scaler's step and update
                    optimizer.step()  # bf16/fp32: a step with inf/NaN gradients is not applied
                optimizer.zero_grad(set_to_none=True)
                step += 1
                # the step's loss: the mean over its micro-batches and over the processes
                loss_value = accelerator.reduce(step_loss, "mean").float().item() / accumulation
                step_loss.zero_()
                if accelerator.is_main_process:
                    record = {"step": step, "loss": loss_value, "lr": optimizer.param_groups[0]["lr"],
                              "grad_norm": grad_norm.item()}
                    if scaler is not None:
                        record["loss_scale"] = scaler.get_scale()
                    log.write(json.dumps(record) + "\n")
                if step % args.log_every == 0 or step == total_steps:
                    accelerator.print(f"Epoch {epoch + 1}, step {step}, Loss: {loss_value:.4f}")
                if step == total_steps:
                    break
        epoch += 1

    val = evaluate(accelerator, model, val_x, val_y)
    accelerator.print(f"done: {step} steps, val_loss {val['val_loss']:.4f}, val_accuracy {val['val_accuracy']:.4f}")
    if accelerator.is_main_process:
        log.write(json.dumps({"step": step, **val}) + "\n")
        log.close()
    # Free the DDP wrapper before its process group: freed after it (when main returns), its Reducer ends gloo's
    # group holding the GIL and the process can hang at exit (torch 2.13; mixprec/compat/teardown.py says why)
    model = None
    accelerator.free_memory()  # drops Accelerate's references to the prepared objects
    accelerator.end_training()


if __name__ == "__main__":
    main()
