"""The model inside the wrappers that `Accelerator.prepare` adds, asking Accelerate only where there is one.

`Accelerator.unwrap_model` looks for a DeepSpeedEngine by importing DeepSpeed whenever it is installed: 0.3 to
0.7 s and DeepSpeed's "Setting accelerator" line, in every process, in runs that do not use DeepSpeed. The
wrappers it removes (DistributedDataParallel, DataParallel, FSDP, DeepSpeedEngine) all hold the model as
`.module`, and Accelerate's `is_compiled_module` tells a torch.compile'd one; a model that is neither is what
`unwrap_model` would return as it is (mixprec never asks it to drop the mixed-precision forward), so it is
returned without the call.
"""
from __future__ import annotations


def unwrap(accelerator, model):
    """`accelerator.unwrap_model(model)`, called only when `model` is wrapped."""
    from accelerate.utils import is_compiled_module

    if hasattr(model, "module") or is_compiled_module(model):
        return accelerator.unwrap_model(model)
    return model
