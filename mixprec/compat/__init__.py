"""Workarounds of the dependencies' behaviour, all in one place.

Each workaround names the upstream behaviour it works around and the versions it was seen in, and has a
canary in tests/test_compat.py that shows the upstream behaviour itself: when an upgrade changes it, the
canary fails, and the workaround can be dropped or changed. Nothing outside this package patches, or
reads or writes private fields of, Accelerate, DeepSpeed, torch or the launchers.

- accelerate_patches: fp16 on a CPU, which Accelerate silently trains in fp32; the autocast that `prepare`
  wraps around `forward`, switched off for evaluation in fp32; the micro-batch counter that `load_state`
  restores.
- deepspeed_patches: DeepSpeed on CPU processes (gloo, and Accelerate's CPU switch); what DDP gives a model
  and DeepSpeed does not (inputs and buffers in the weights' dtype, buffers broadcast from process 0); the
  dtype of the master weights inside DeepSpeed's ZeRO optimizers, which only their internal fields tell;
  transformers models built inside `deepspeed.zero.Init` under ZeRO-3 although `zero3_init_flag` is false.
- schedulers: a scheduler's peak learning rates, which no public method sets (a resume with a new --lr).
- launcher: `accelerate launch` with one process does not stop its child when it dies, and either does not
  pass signals on (1.15) or SIGKILLs the child 5 s after passing one on (1.16).
- serialization: safetensors and torch.save report a full or read-only disk without OSError; safetensors
  writes its files with mode 0600 whatever the umask.
- teardown: a process of a multi-process run can abort in the interpreter's teardown after a completed run.

Names are imported on first use (`compat.autocast_off`), so that `mixprec.compat.teardown`, which the recipe's
process end (mixprec.process_end) needs before anything else, does not import torch.
"""
from __future__ import annotations

import importlib

_WHERE = {"autocast_off": "accelerate_patches", "fp16_on_cpu": "accelerate_patches",
          "restart_accumulation": "accelerate_patches",
          "deepspeed_on_cpu": "deepspeed_patches", "like_ddp": "deepspeed_patches",
          "zero_master_dtype": "deepspeed_patches", "whole_weights_under_zero3": "deepspeed_patches",
          "peak_lrs": "schedulers", "set_peak_lrs": "schedulers",
          "stop_with_launcher": "launcher", "outlive_launcher": "launcher",
          "storage_failure": "serialization", "umask_modes": "serialization", "must_skip": "teardown", "exit_now": "teardown"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
