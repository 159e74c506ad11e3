"""DeepSpeed through Accelerate on CPU processes, and what DeepSpeed does to the model (deepspeed 0.19.8,
accelerate 1.15.0; canaries: tests/test_compat.py)."""
from __future__ import annotations

import os

import torch


def deepspeed_on_cpu(device_type: str) -> dict:
    """Accelerator kwargs that engage DeepSpeed when the processes run on CPUs.

    - Accelerate engages its DeepSpeed plugin only with `cpu=False`, and the environment variable
      ACCELERATE_USE_CPU=true (which CPU-only SLURM jobs export for plain multi-process runs) forces `cpu=True`
      and so silently turns DeepSpeed off. DeepSpeed then picks its CPU accelerator by itself.
    - On CPUs Accelerate must be told the gloo backend; otherwise it counts one process per group and
      DeepSpeed's batch check fails ("train_batch_size ... 64 != 64 * 1 * 2").
    """
    from accelerate.utils import InitProcessGroupKwargs

    if os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        os.environ["ACCELERATE_USE_CPU"] = "false"
    handlers = [InitProcessGroupKwargs(backend="gloo")] if device_type == "cpu" else []
    return {"cpu": False, "kwargs_handlers": handlers}


def cast_inputs_to_weights(model: torch.nn.Module) -> None:
    """DeepSpeed bf16/fp16 casts the model's weights themselves to 16 bits and runs no autocast, so a model
    fed fp32 inputs fails ("Input type (float) and bias type (c10::BFloat16) should be the same"). Floating
    inputs are cast to the weights' dtype on the way in. (Models that turn integer inputs into floats, like
    the CNN's pixels, cast to their own weights' dtype themselves.)"""
    dtype = next(model.parameters()).dtype
    if dtype == torch.float32:
        return

    def cast(_module, args):
        return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    model.register_forward_pre_hook(cast)
