"""The precision doctor: the lesson's fp16 analysis, for any recipe model, on its real weights and gradients.

`analyze` returns one dict (written as JSON by `recipes/precision_report.py`):
- weights: per parameter, the largest |value| and the fp16 / bf16 round-trip error (the lesson's table);
- gradients: the fp32 gradients of a few real batches, cast to fp16 at loss scale 1, at the chosen
  `--init_scale`, at every power of two from 2**-8 to 2**30, and to bf16: the share flushed to zero, left
  subnormal (precision lost) or overflowing; per parameter; the lesson's 1e-6 ... 1e-9 demonstration on
  the model's own gradient values; a histogram of log10 |gradient|;
- autocast: the same batches run under fp16 and bf16 autocast, measured against fp32: the loss, NaN/Inf
  per layer, and the gradients of real backward passes at loss scale 1, the chosen and the recommended one;
- activations: per layer (forward hooks), the largest |output| in fp32, and which layers exceed fp16's 65504;
- memory: parameters, gradients, AdamW state and activations for one batch in fp32, fp16, bf16 and int8;
- fp8: per Linear layer, its weight, input and output gradient through E4M3 / E5M2 with tensorwise, delayed
  and rowwise scaling (flushed, overflowing, SQNR), its GEMM shapes, and the layers to keep out of fp8
  (mixprec.doctor.fp8: simulated fp8 numerics, not fp8 speed);
- fp32_modules: the layers to keep in fp32 for fp16, as the flag recipes/train.py takes (`--fp32_modules
  net.2,net.4`), checked: the batches' forward passes under fp16 autocast with those layers in fp32
  (train.py's own `mixprec.precision.policy`) hold no NaN/Inf;
- verdict: bf16 is safe / fp16 with --init_scale X / keep these layers in fp32: --fp32_modules ...
"""
from __future__ import annotations

import copy
import math
import sys

import torch
from tqdm.auto import tqdm

from . import analysis, fp8, memory
from .analysis import FORMATS, limits

UNDERFLOW_OK = 1e-3  # at most 0.1% of the nonzero gradient values flushed to zero
FP16_MAX = limits(torch.float16)["max"]


def _seeded_forward_backward(model, batch, loss_fn, seed: int):
    """The fp32 reference for one batch: loss and gradients, with the batch's own dropout masks."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    with torch.autocast(device_type=batch["labels"].device.type, enabled=False):
        loss = loss_fn(model(batch["inputs"]), batch["labels"])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def analyze(model, batches: list[dict], loss_fn, device: torch.device, chosen_scale: float,
            bf16_native: tuple[bool, str] = (True, ""), progress: bool = True,
            fp8_threshold: float = fp8.SQNR_THRESHOLD) -> dict:
    model.train()
    bar = tqdm(total=2 * len(batches) + 1, desc="precision report", disable=not progress, dynamic_ncols=True,
               mininterval=1 if sys.stderr.isatty() else 30)
    report = {"weights": analysis.weight_table(model)}

    # pass 1: fp32 gradients and activations of every batch; each Linear layer's operands through fp8
    grads, layers, linears = analysis.GradientStats(chosen_scale), {}, {}
    with analysis.activation_hooks(model, layers), fp8.collect(model, linears):
        for i, batch in enumerate(batches):
            _, g = _seeded_forward_backward(model, batch, loss_fn, seed=i)
            grads.add(g.items())
            bar.update()
    report["fp8"] = fp8.readiness(model, linears, fp8_threshold)
    recommended = grads.recommended_scale()
    report["gradients"] = grads.summary(recommended)
    report["demonstration"] = grads.demonstration(chosen_scale)

    # pass 2: the same batches under fp16 and bf16 autocast, against a fresh fp32 reference
    checks = {"fp16": analysis.AutocastCheck(torch.float16, sorted({1.0, chosen_scale, recommended})),
              "bf16": analysis.AutocastCheck(torch.bfloat16, [1.0])}
    for i, batch in enumerate(batches):
        ref_loss, ref = _seeded_forward_backward(model, batch, loss_fn, seed=i)
        for check in checks.values():
            torch.manual_seed(i)
            check.add(model, batch, loss_fn, device, ref, ref_loss)
        bar.update()
    report["autocast"] = {fmt: check.result() for fmt, check in checks.items()}
    report["activations"] = activation_rows(layers, report["autocast"])
    report["fp32_modules"] = fp32_modules(model, batches, loss_fn, device, report["activations"])

    report["memory"] = memory.measure(model, batches[0], loss_fn, device)
    bar.update()
    bar.close()
    report["verdict"] = verdict(report, chosen_scale, bf16_native)
    return report


def activation_rows(fp32_layers: dict, autocast: dict) -> list[dict]:
    rows = []
    for name, row in fp32_layers.items():
        out = {"layer": name, **{k: row[k] for k in ("module", "shape", "max_abs", "input_max_abs")}}
        out["exceeds_fp16"] = row["max_abs"] > FP16_MAX
        out["overflow_starts_here"] = out["exceeds_fp16"] and row["input_max_abs"] <= FP16_MAX
        for fmt, result in autocast.items():
            amp = result["layers"].get(name, {})
            out[f"{fmt}_nonfinite"] = amp.get("nonfinite", 0)
            out[f"{fmt}_nonfinite_from_finite_input"] = amp.get("nonfinite_from_finite_input", 0)
        rows.append(out)
    return rows


def fp32_modules(model, batches: list[dict], loss_fn, device: torch.device, activations: list[dict],
                 rounds: int = 8) -> dict:
    """The layers to keep in fp32 so that fp16 autocast's forward passes stay finite, as recipes/train.py's
    --fp32_modules flag. It starts from the layers where fp16 overflow begins (an output above 65504 from an
    input below, or NaN/Inf from finite inputs under fp16 autocast); the layers after them may then receive
    fp32 inputs above 65504, which autocast casts to inf. So: run the batches under fp16 autocast with the
    list kept in fp32 (`policy.keep_fp32`, what train.py does), add each layer whose output turns NaN/Inf
    from finite inputs, and repeat until none does. `checked`: the loss and every layer stay finite."""
    from ..precision import policy

    names = {n for n, _ in model.named_modules() if n}  # a flag cannot name the model itself
    keep = [a["layer"] for a in activations if a["layer"] in names and
            (a["overflow_starts_here"] or a["fp16_nonfinite_from_finite_input"])]
    checked = not keep
    for _ in range(rounds if keep else 0):
        trial, layers, finite = copy.deepcopy(model), {}, True
        policy.keep_fp32(trial, keep)
        with torch.no_grad(), analysis.activation_hooks(trial, layers), \
                torch.autocast(device_type=device.type, dtype=torch.float16):
            for i, batch in enumerate(batches):
                torch.manual_seed(i)
                finite &= bool(torch.isfinite(loss_fn(trial(batch["inputs"]), batch["labels"])))
        new = [n for n, row in layers.items() if row["nonfinite_from_finite_input"] and n in names and n not in keep]
        checked = finite and not any(row["nonfinite"] for row in layers.values())
        if checked or not new:
            break
        keep += new
    return {"layers": keep, "flag": f"--fp32_modules {','.join(keep)}" if keep else "", "checked": checked}


def verdict(report: dict, chosen: float, bf16_native: tuple[bool, str]) -> dict:
    grads, amp, acts = report["gradients"], report["autocast"], report["activations"]
    fix = report.get("fp32_modules") or {"layers": [], "flag": "", "checked": True}
    keep_fp32 = fix["layers"]
    starts = [a["layer"] for a in acts if a["overflow_starts_here"] or a["fp16_nonfinite_from_finite_input"]]
    rec = grads["recommended_scale"]
    at_rec, at_chosen = grads["fp16"]["recommended"], grads["fp16"]["chosen"]
    problems = {fmt: [] for fmt in FORMATS}
    for fmt in FORMATS:
        overflowing = [w["name"] for w in report["weights"] if w[fmt]["overflow"]]
        if overflowing:
            problems[fmt].append(f"weights above its range in {', '.join(overflowing)}")
        if not math.isfinite(amp[fmt]["loss"]):
            problems[fmt].append(f"the loss under {fmt} autocast is {amp[fmt]['loss']}")
    if grads["bf16"]["flushed_to_zero"] > UNDERFLOW_OK:
        problems["bf16"].append(f"{grads['bf16']['flushed_to_zero']:.2%} of the gradient values flush to zero")
    if starts:
        problems["fp16"].append(f"activations exceed {FP16_MAX:g} in {', '.join(starts)}")
    if at_rec["overflow"] or at_rec["flushed_to_zero"] > UNDERFLOW_OK:
        problems["fp16"].append(f"even at the best loss scale ({rec:g}) {at_rec['flushed_to_zero']:.2%} of the gradient "
                                f"values flush to zero and {at_rec['overflow']:.2%} overflow: their range is wider "
                                f"than fp16's")
    native, why = bf16_native
    lines = []
    if not problems["bf16"]:
        lines.append("bf16 is safe" + (f" (and native here: {why})" if native else
                                       f" numerically, but not native here ({why}): it would run emulated, slower"))
    else:
        lines.append("bf16 is not safe: " + "; ".join(problems["bf16"]))
    if not problems["fp16"]:
        text = f"fp16 is safe with --init_scale {rec:g}"
        if at_chosen["overflow"]:
            text += (f" (at the chosen {chosen:g}, {at_chosen['overflow']:.2%} of the gradient values overflow: the "
                     f"GradScaler would skip steps while it backs off)")
        elif at_chosen["flushed_to_zero"] > UNDERFLOW_OK:
            text += f" (at the chosen {chosen:g}, {at_chosen['flushed_to_zero']:.2%} of the gradient values flush to zero)"
        lines.append(text)
    else:
        lines.append("fp16 is not safe: " + "; ".join(problems["fp16"]))
    if keep_fp32:
        lines.append(f"keep these layers in fp32 for fp16 (their outputs exceed fp16's {FP16_MAX:g}, or their "
                     f"inputs do once the layers before them are in fp32): {fix['flag']}" +
                     (" (checked: the same batches under fp16 autocast with these layers in fp32 give no NaN/Inf "
                      "in the forward pass)" if fix["checked"] else
                      " (not enough: the forward pass under fp16 autocast still gives NaN/Inf with these layers "
                      "in fp32; use bf16)"))
    lines += fp8_lines(report.get("fp8"))
    bf16_ok, fp16_ok = not problems["bf16"], not problems["fp16"]
    recommendation = ("bf16" if bf16_ok and native else f"fp16 --init_scale {rec:g}" if fp16_ok else
                      "bf16" if bf16_ok else "fp32")
    return {"bf16_safe": bf16_ok, "fp16_safe": fp16_ok, "fp16_init_scale": rec, "keep_fp32": keep_fp32,
            "fp32_modules_flag": fix["flag"], "fp32_modules_checked": fix["checked"],
            "recommendation": recommendation, "lines": lines}


def fp8_lines(section: dict | None) -> list[str]:
    if not section or not section["layers"]:
        return []
    low = [e["layer"] for e in section["exclude"] if any(r.startswith("SQNR") for r in e["reasons"])]
    lost = [e["layer"] for e in section["exclude"] if any(" loses " in r for r in e["reasons"])]
    threshold = f"SQNR below {section['sqnr_threshold_db']:g} dB"
    why = (f"the first and last Linear layers; {threshold}: {', '.join(low) if low else 'none'}; more than "
           f"{section['lost_threshold']:.0%} of an operand's values, or {section['channel_lost_threshold']:.0%} of "
           f"a weight's output channel, lost to zero or saturation: {', '.join(lost) if lost else 'none'}")
    return [f"fp8 (simulated numerics, not speed): keep {len(section['exclude'])} Linear layers out of fp8 ({why}): "
            f"{section['fp32_modules_flag']}"]
