"""The validation pass: `evaluate` runs the model under `model.eval()` and `torch.no_grad()`, in fp32 unless asked
otherwise, over this process's share of the validation rows (`data.batches.EvalBatches`), and sums the per-row
loss and accuracy over all processes (mixprec.evaluation.per_row): every target counts once, padding (weight 0)
not at all. With several processes the model's buffers (BatchNorm's running statistics, which each process
updates on its own batches) are first taken from process 0, as DDP does before each training forward: every
process evaluates the model that model.safetensors holds. bf16 master weights are upcast for the pass.
"""
from __future__ import annotations

import torch

from .. import compat
from ..evaluation import accumulation_dtype, per_row
from ..precision.master_weights import upcast as upcast_weights
from ..unwrap import unwrap


def upcast(model, accelerator, fp32: bool):
    """fp32 evaluation of bf16 master weights (--master_weights bf16): upcast for the pass (DeepSpeed: its own)."""
    return upcast_weights(unwrap(accelerator, model), fp32 and accelerator.distributed_type.name != "DEEPSPEED")


def evaluate(model, batches, accelerator, fp32: bool = True) -> dict:
    """{'val_loss', 'val_accuracy'} over the whole validation set (all processes)."""
    dtype = accumulation_dtype(accelerator.device)
    sums = torch.zeros(3, dtype=dtype, device=accelerator.device)  # loss, hits, targets (rows or tokens)
    if accelerator.num_processes > 1:
        for buffer in unwrap(accelerator, model).buffers():
            if buffer.is_floating_point():
                torch.distributed.broadcast(buffer.data, src=0)
    model.eval()
    with torch.no_grad(), compat.autocast_off(model, accelerator, enabled=fp32), upcast(model, accelerator, fp32):
        for batch in batches:
            loss, hit, targets = per_row(model(batch["inputs"]), batch["labels"])
            weight = batch["weight"].to(dtype)
            sums += torch.stack([(loss.to(dtype) * weight).sum(), (hit.to(dtype) * weight).sum(),
                                 (targets.to(dtype) * weight).sum()])
    model.train()
    if accelerator.num_processes > 1:
        sums = accelerator.reduce(sums, "sum")
    loss, hits, targets = sums.tolist()
    return {"val_loss": loss / targets, "val_accuracy": hits / targets}
