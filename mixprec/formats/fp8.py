"""fp8 numerics on any CPU: torch's float8 dtypes (float8_e4m3fn, float8_e5m2) with the scaling recipes of
the fp8 training libraries. A simulation of fp8 numerics, not of fp8 speed.

A value x is sent to fp8 as `clamp(x * scale, -max, max).to(float8)` and read back as `q / scale`:
- tensorwise: one scale per tensor, max / amax(tensor) (torchao's tensorwise recipe, the default of
  Accelerate's AO backend; TransformerEngine's current scaling);
- delayed: one scale per tensor from the amax of the previous batch (TransformerEngine's delayed scaling,
  amax_compute_algo most_recent): a value above that amax saturates (counted as an overflow);
- rowwise: one scale per row (along the last dimension), rounded down to a power of two (torchao's
  rowwise recipe, round_scales_to_power_of_2).
E4M3 (max 448, 3 mantissa bits) is what every recipe uses for weights and activations; the output
gradients use E5M2 (max 57344, 2 mantissa bits) in tensorwise / HYBRID recipes and E4M3 in rowwise.

Which Linear layers fp8 converts is Accelerate's own rule (`accelerate.utils.ao.filter_linear_layers`): in
and out features divisible by 16 (what `torch._scaled_mm` takes), not the first and the last Linear layer
of the model; `--fp32_modules` adds its layers to that exclusion (mixprec.precision.policy).
"""
from __future__ import annotations

import math

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
EPS = 1e-12  # the smallest amax a scale is computed from (torchao's EPS)
GEMM_MULTIPLE = 16


def scale_for(x: torch.Tensor, fmt: str, recipe: str, amax: torch.Tensor | None = None) -> torch.Tensor:
    """The scale of `x` (a scalar tensor, or one per row for rowwise)."""
    top = torch.finfo(FORMATS[fmt]).max
    if recipe == "rowwise":
        amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
        return torch.exp2(torch.floor(torch.log2(top / amax.clamp(min=EPS))))
    if amax is None:
        amax = x.detach().abs().max().float()
    return top / amax.clamp(min=EPS)


def quantize(x: torch.Tensor, fmt: str, recipe: str = "tensorwise", amax=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fp8 values as fp32, the scale): x ~ q / scale. Values beyond the format's max saturate."""
    scale = scale_for(x, fmt, recipe, amax)
    top = torch.finfo(FORMATS[fmt]).max
    q = (x.float() * scale).clamp(-top, top).to(FORMATS[fmt]).float()
    return q, scale


def sqnr_db(err_sq: float, ref_sq: float) -> float:
    """10 log10(signal power / error power); inf for an exact copy, -inf for a NaN/Inf error."""
    if not math.isfinite(err_sq):
        return -math.inf
    if err_sq == 0:
        return math.inf
    return 10 * math.log10(ref_sq / err_sq) if ref_sq > 0 else -math.inf


# --- which Linear layers fp8 converts (Accelerate's rule) ---------------------------------------------------------

def converted_linears(model: torch.nn.Module, keep: list[str] = ()) -> dict[str, str | None]:
    """name -> None for each Linear layer that Accelerate's AO backend would convert to fp8, or the reason it
    is not: 'first Linear layer', 'last Linear layer', 'in/out features not divisible by 16' (those stay in
    bf16), '--fp32_modules' (fp32). `keep`: the module names kept in fp32 (their Linear layers included)."""
    from accelerate.utils.ao import filter_linear_layers, find_first_last_linear_layers

    first, last = find_first_last_linear_layers(model)
    kept = set(keep)
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        inside = name in kept or any(name.startswith(k + ".") for k in kept)
        if filter_linear_layers(module, name, [first, last]) and not inside:
            out[name] = None
        elif inside:
            out[name] = "--fp32_modules"
        elif name == first:
            out[name] = "first Linear layer"
        elif name == last:
            out[name] = "last Linear layer"
        else:
            out[name] = f"in/out features not divisible by {GEMM_MULTIPLE}"
    return out


# --- fp8 matmuls for the diff ------------------------------------------------------------------------------------------

def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def _gemm(a: torch.Tensor, a_fmt: str, b: torch.Tensor, b_fmt: str, recipe: str) -> torch.Tensor:
    """a (M, K) @ b (N, K)^T with both operands quantised along K (the reduction), fp32 accumulation."""
    aq, sa = quantize(a, a_fmt, recipe)
    bq, sb = quantize(b, b_fmt, recipe)
    return (aq @ bq.t()) / (sa * sb.t() if recipe == "rowwise" else sa * sb)


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T + b with fp8 operands in all three GEMMs, as torchao's Float8Linear under bf16 autocast:
    forward x, W in E4M3; backward the output gradient in E5M2 (tensorwise) or E4M3 (rowwise); outputs and
    input gradients bf16."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        ctx.recipe, ctx.shape, ctx.has_bias = recipe, x.shape, bias is not None
        x2 = _bf16(x.reshape(-1, x.shape[-1]))  # autocast hands Float8Linear a bf16 input
        ctx.save_for_backward(x2, weight)
        y = _bf16(_gemm(x2, "e4m3", weight, "e4m3", recipe))
        if bias is not None:
            y = _bf16(y + _bf16(bias))
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        recipe = ctx.recipe
        g = _bf16(grad.reshape(-1, grad.shape[-1]))
        g_fmt = "e4m3" if recipe == "rowwise" else "e5m2"
        grad_x = _bf16(_gemm(g, g_fmt, weight.t().contiguous(), "e4m3", recipe)).reshape(ctx.shape)
        grad_w = _bf16(_gemm(g.t().contiguous(), g_fmt, x2.t().contiguous(), "e4m3", recipe))
        grad_b = _bf16(g.sum(0)) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str) -> torch.Tensor:
    return _Fp8Linear.apply(x, weight, bias, recipe)
