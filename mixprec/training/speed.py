"""Speed options, applied to the model before `accelerator.prepare`, and recorded.

- `--compile`: `torch.compile` in place (`model.compile()`), so parameter names, checkpoints and the saved
  weights are the same as without it (a compiled run resumes an uncompiled checkpoint and back). On a CPU,
  inductor needs a C++ compiler.
- fused AdamW on CUDA and CPUs, automatic (one kernel for the whole update instead of one per tensor; on the
  2-core CPU several times faster than the default, and it reads nothing back from the device).
- `--tf32`: fp32 matmuls and convolutions on TF32 tensor cores (CUDA, Ampere or newer). Without it the
  recipe sets IEEE fp32 explicitly on CUDA, where PyTorch's own default runs cuDNN convolutions in TF32.
- `--activation_checkpointing` (GPT): each block keeps only its input and recomputes the rest during the
  backward pass: less activation memory for about a third more compute (not counted in MFU).
- `--gradient_checkpointing` (transformers' name): a transformers model's own
  `activation_checkpointing_enable` (non-reentrant; transformers 5's new name for `gradient_checkpointing_enable`,
  which warns that it is deprecated); the GPT's `--activation_checkpointing`; refused for the other models.
  Measured by benchmarks/gradient_checkpointing.py (docs/hf-models.md).
- DataLoader: `--num_workers` processes; pinned memory on CUDA.
"""
from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

import torch

from .. import models
from ..errors import UsageError

if TYPE_CHECKING:
    from ..config.sections import ModelSettings, SpeedSettings


def check(speed: SpeedSettings, cfg: ModelSettings, device: torch.device) -> None:
    """Refuse options this run cannot honour, before any data is prepared (UsageError)."""
    if speed.tf32 and device.type != "cuda":
        raise UsageError(f"--tf32 is for fp32 training on CUDA GPUs (Ampere or newer); this run is on "
                         f"{device.type}: drop --tf32")
    if speed.tf32 and torch.cuda.get_device_capability(device)[0] < 8:
        raise UsageError(f"--tf32 needs an Ampere or newer GPU; {torch.cuda.get_device_name(device)} has no TF32: "
                         f"drop --tf32")
    if speed.activation_checkpointing and not models.supports(cfg.model, "activation_checkpointing"):
        raise UsageError(f"--activation_checkpointing is for the gpt models, not --model {cfg.model}: drop it")
    if speed.gradient_checkpointing and not models.supports(cfg.model, "gradient_checkpointing"):
        raise UsageError(f"--gradient_checkpointing is for transformers models and the gpt models, not --model "
                         f"{cfg.model}: drop it")
    if speed.compile and device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise UsageError("--compile on a CPU needs a C++ compiler (g++ or clang++): install one or drop --compile")


def check_model(speed: SpeedSettings, model: torch.nn.Module) -> None:
    """Refuse --gradient_checkpointing for a transformers architecture without it (once the model is built)."""
    hf = getattr(model, "hf", None)
    if speed.gradient_checkpointing and hf is not None and not getattr(hf, "supports_gradient_checkpointing", False):
        raise UsageError(f"--gradient_checkpointing: {type(hf).__name__} does not support gradient checkpointing "
                         f"in transformers: drop it")


def apply(speed: SpeedSettings, cfg: ModelSettings, model: torch.nn.Module, device: torch.device) -> dict:
    """Switch on what the speed section asks for on `model` (not yet prepared); returns what is in effect."""
    check(speed, cfg, device)
    if device.type == "cuda":  # explicit either way: PyTorch's default runs cuDNN convolutions in TF32
        torch.backends.cuda.matmul.fp32_precision = "tf32" if speed.tf32 else "ieee"
        torch.backends.cudnn.fp32_precision = "tf32" if speed.tf32 else "ieee"
    if speed.activation_checkpointing or (speed.gradient_checkpointing and not hasattr(model, "hf")):
        model.activation_checkpointing = True
    if speed.gradient_checkpointing and hasattr(model, "hf"):
        check_model(speed, model)
        model.hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if speed.compile:
        model.compile()
    return {"compile": speed.compile, "fused_adamw": fused_adamw(device), "tf32": speed.tf32,
            "activation_checkpointing": speed.activation_checkpointing,
            "gradient_checkpointing": speed.gradient_checkpointing, "num_workers": speed.num_workers,
            "pin_memory": device.type == "cuda"}


def fused_adamw(device: torch.device) -> bool:
    return device.type in ("cuda", "cpu")


def describe(speed: dict) -> str:
    on = [name for name in ("compile", "fused_adamw", "tf32", "activation_checkpointing", "gradient_checkpointing",
                            "pin_memory") if speed.get(name)]
    return (f"speed          {', '.join(on) or 'no options'}; {speed['num_workers']} DataLoader workers")
