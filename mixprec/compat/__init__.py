"""Workarounds of the dependencies' behaviour, all in one place.

Each workaround names the upstream behaviour it works around and the versions it was seen in, and has a
canary in tests/test_compat.py that shows the upstream behaviour itself: when an upgrade changes it, the
canary fails, and the workaround can be dropped or changed. Nothing outside this package patches, or
writes private fields of, Accelerate, DeepSpeed, torch or the launchers.

- accelerate_patches: per-step importlib lookups and a DeepSpeed import in plain runs; fp16 on a CPU, which
  Accelerate silently trains in fp32; the autocast that `prepare` wraps around `forward`, switched off for
  evaluation in fp32; the micro-batch counter that `load_state` restores.
- deepspeed_patches: DeepSpeed on CPU processes (gloo, and Accelerate's CPU switch); what DDP gives a model
  and DeepSpeed does not (inputs and buffers in the weights' dtype, buffers broadcast from process 0).
- launcher: `accelerate launch` neither forwards signals to its one child nor stops it when it dies.
- serialization: safetensors and torch.save report a full or read-only disk without OSError.
"""
from .accelerate_patches import autocast_off, fp16_on_cpu, restart_accumulation, skip_per_step_overheads
from .deepspeed_patches import deepspeed_on_cpu, like_ddp
from .launcher import stop_with_launcher
from .serialization import storage_failure

__all__ = ["autocast_off", "deepspeed_on_cpu", "like_ddp", "restart_accumulation", "fp16_on_cpu",
           "skip_per_step_overheads", "stop_with_launcher", "storage_failure"]
