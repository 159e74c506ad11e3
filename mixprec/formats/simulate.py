"""Simulated precisions: the numerics of bf16 / fp16 autocast (and of fp8 Linear layers) computed with fp32
kernels, so that a CPU without native 16-bit arithmetic can show their effect at fp32 speed.

What autocast does on a GPU (and on CPUs with AMX-BF16 / AVX512-FP16): the ops of its lower-precision list
(matmuls, linear, convolutions, attention) cast their floating inputs to 16 bits, multiply with fp32
accumulation (tensor cores, AMX) and write a 16-bit result; everything else (layer norms, softmax,
losses, embeddings) keeps fp32. The simulation does the same arithmetic around fp32 kernels:

- the inputs of those ops are rounded to the 16-bit format (and back to fp32), the op runs in fp32 (fp32
  accumulation, as the hardware does), its output is rounded to the 16-bit format: bit for bit what a
  16-bit tensor would hold, inf above fp16's 65504 included;
- the rounding is an autograd function whose backward rounds the gradient too: the gradient reaching a
  16-bit output is 16-bit, and the gradients a 16-bit matmul's backward computes for its inputs are
  16-bit, as under real autocast. Whether an op is rounded is decided when its forward runs, so a module
  kept in fp32 (`mixprec.precision.policy`) has an fp32 backward too;
- what it leaves out: elementwise ops that follow a 16-bit op (GELU, residual adds of 16-bit outputs)
  compute in fp32 here, in 16 bits under real autocast, and a kernel's internal order of summation differs.
  So the simulation is faithful to a rounding error per element of those ops, not bit-exact.

The ops are caught with a `TorchFunctionMode` (above autograd, which is what lets the backward follow the
forward). Functions that do their own matmuls inside one torch function (nn.MultiheadAttention's fused
path) are not rounded inside: for those models use real autocast (`--simulate never`).

One mode object serves every precision: `computing(fmt, ...)` sets the format for the block, nested
blocks (a module measured in another precision inside a forward pass, a module kept in fp32) set and
restore it. The format is process-wide, not thread-local, so that autograd's device threads see it.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}  # fp8: other ops in bf16
ROUNDED = {F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
           F.conv_transpose3d, F.scaled_dot_product_attention, F.prelu,
           torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.addbmm, torch.mv, torch.addmv,
           torch.addr, torch.einsum, torch.chain_matmul, torch.linalg.multi_dot,
           torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.Tensor.mm,
           torch.Tensor.bmm, torch.Tensor.addmm, torch.Tensor.baddbmm, torch.Tensor.mv}


class _Round(torch.autograd.Function):
    """x -> x rounded to `dtype` (kept in x's dtype); the gradient is rounded the same way."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).to(grad.dtype), None


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` rounded to `dtype` (gradients too) where it is a wider floating tensor; anything else unchanged."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and torch.finfo(x.dtype).bits > torch.finfo(dtype).bits:
        return _Round.apply(x, dtype)
    return x


def _map(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    return value


class _Mode(TorchFunctionMode):
    fmt: str | None = None  # the simulated format now: None (fp32), bf16, fp16 or fp8

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fmt = _Mode.fmt
        if fmt is None or func not in ROUNDED:
            return func(*args, **kwargs)
        dtype = LOW[fmt]
        rnd = lambda t: round_to(t, dtype)  # noqa: E731
        out = func(*_map(args, rnd), **{k: _map(v, rnd) for k, v in kwargs.items()})
        return _map(out, rnd)


_MODE = _Mode()
_active = 0  # how many `computing` blocks are open: the mode is pushed by the outermost one


def current() -> str | None:
    """The simulated format in effect (None: none)."""
    return _Mode.fmt


@contextlib.contextmanager
def computing(fmt: str | None, device_type: str = "cpu", real: bool = False):
    """Compute the block in `fmt` (None or 'no': fp32): simulated (this module), or `real` autocast. The
    other kind is switched off inside, so blocks nest: the innermost decides."""
    global _active
    fmt = None if fmt in (None, "no") else fmt
    autocast = torch.autocast(device_type, dtype=LOW.get(fmt, torch.bfloat16), enabled=bool(real and fmt))
    before = _Mode.fmt
    _Mode.fmt = None if real else fmt
    _active += 1
    try:
        if _active == 1:
            with _MODE, autocast:
                yield
        else:
            with autocast:
                yield
    finally:
        _active -= 1
        _Mode.fmt = before


@contextlib.contextmanager
def paused():
    """No simulated rounding inside (a module kept in fp32). Costs nothing when no simulation runs."""
    before = _Mode.fmt
    _Mode.fmt = None
    try:
        yield
    finally:
        _Mode.fmt = before


def describe(fmt: str, simulated: bool, why: str = "", fp8_recipe: str = "tensorwise") -> str:
    """One line that says how `fmt` was computed, for every output of a tool that uses this module."""
    if fmt in (None, "no"):
        return "fp32 (no autocast)"
    if fmt == "fp8":
        return (f"fp8 simulated: Linear layers that fp8 would convert quantise their inputs and weights to E4M3 and "
                f"their output gradients to {'E4M3' if fp8_recipe == 'rowwise' else 'E5M2'} with {fp8_recipe} "
                f"scales, fp32 accumulation, bf16 output; everything else bf16 simulated (a simulation of fp8 "
                f"numerics, not of fp8 speed)")
    if simulated:
        return (f"{fmt} simulated: matmul inputs rounded to {fmt}, fp32 accumulation, {fmt} outputs"
                + (f" ({why})" if why else ""))
    return f"{fmt} autocast (real {fmt} kernels)" + (f" ({why})" if why else "")
