"""DeepSpeed through Accelerate on CPU processes, and what DeepSpeed does to the model (deepspeed 0.19.8,
accelerate 1.15.0; canaries: tests/test_compat.py)."""
from __future__ import annotations

import contextlib
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


def like_ddp(model: torch.nn.Module) -> None:
    """What a model needs under DeepSpeed that DDP gives it:

    - DeepSpeed bf16/fp16 casts the parameters themselves to 16 bits and runs no autocast, so floating inputs
      are cast to them on the way in ("Input type (float) and bias type (c10::BFloat16) should be the same");
      models that turn integer inputs into floats (the CNN's pixels) cast to their own weights' dtype themselves;
    - it leaves the buffers (BatchNorm's running statistics) in fp32, which CPU BatchNorm refuses beside bf16
      weights ("expected scalar type BFloat16 but found Float"): they are cast to the parameters' dtype;
    - it never synchronises buffers across processes, where DDP broadcasts them from process 0 before every
      training forward (broadcast_buffers=True): the running statistics drift apart per process, evaluation
      mixes them, and a checkpoint (process 0's) resumes into other numbers. They are broadcast the same way.
    """
    dtype = next(model.parameters()).dtype
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    for b in buffers:
        b.data = b.data.to(dtype)

    def before_forward(module, args):
        if module.training and buffers and torch.distributed.is_initialized():
            for b in buffers:
                torch.distributed.broadcast(b.data, src=0)
        if dtype == torch.float32:
            return args
        return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    model.register_forward_pre_hook(before_forward)


ZERO_MASTER_FIELDS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat")


def zero_master_dtype(optimizer) -> str | None:
    """The dtype of the master weights inside a DeepSpeed ZeRO optimizer (None elsewhere). DeepSpeed has no
    public way to ask: its ZeRO-1/2 optimizer keeps them in `single_partition_of_fp32_groups`, ZeRO-3 in
    `fp32_partitioned_groups_flat`, its bf16 optimizer in `fp32_groups_flat` (canary: tests/test_compat.py)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    for name in ZERO_MASTER_FIELDS:
        groups = getattr(inner, name, None)
        if groups:
            return str(groups[0].dtype).replace("torch.", "")
    return None


@contextlib.contextmanager
def whole_weights_under_zero3():
    """Build a transformers model with whole weights on every process, as the built-in models are built, under
    ZeRO-3. Accelerate (1.16) always registers its DeepSpeed config with transformers (`set_deepspeed_weakref`),
    even with `zero3_init_flag: false`, and transformers (5.x) then builds every model inside
    `deepspeed.zero.Init`: empty, partitioned parameters before `prepare`. Hidden here while the model loads;
    `prepare` partitions the weights as it does the built-in models'."""
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:  # pragma: no cover (transformers is installed with the recipe)
        yield
        return
    ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = ref
