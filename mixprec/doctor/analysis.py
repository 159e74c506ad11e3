"""What fp16 and bf16 would do to a model's real weights, gradients and activations: measured by casting
the real values (and by running the model under autocast), not computed from formulas.

Gradients are the fp32 gradients of a few real batches (the reference). For each loss scale s, a
gradient value g counts as
- flushed to zero when `(g * s).to(fp16) == 0` while g != 0,
- losing precision when the result is a subnormal number (nonzero, below fp16's smallest normal, 6.1e-5),
- overflowing when the result is inf (above 65504),
and its relative error is |fp16(g * s) / s - g| / |g|. Nothing is kept per value: the statistics stream,
so the analysis fits any model that fits in memory.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

FORMATS = {"fp16": torch.float16, "bf16": torch.bfloat16}
SCALES = [2.0 ** k for k in range(-8, 31)]  # the loss scales tried: 1/256 ... 2**30
HEADROOM = 8  # the recommended scale leaves 3 doublings before the analysed gradients overflow
DECADES = [1e-6, 1e-7, 1e-8, 1e-9]  # the lesson's demonstration values
HIST_EDGES = np.arange(-46.0, 40.05, 0.1)  # log10 |gradient| bins: every value a float32 can hold


def limits(dtype: torch.dtype) -> dict:
    fi = torch.finfo(dtype)
    return {"max": fi.max, "min_normal": fi.tiny, "min_subnormal": fi.tiny * fi.eps}


def cast_counts(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> dict:
    """`values`: nonzero fp32 numbers. What casting `values * scale` to `dtype` does to them."""
    q = (values * scale).to(dtype)
    zero, inf = q == 0, torch.isinf(q)
    sub = ~zero & (q.abs() < torch.finfo(dtype).tiny)
    kept = ~(zero | inf)
    rel = ((q[kept].double() / scale - values[kept]).abs() / values[kept].abs()).sum().item()
    return {"n": values.numel(), "zero": int(zero.sum()), "subnormal": int(sub.sum()), "overflow": int(inf.sum()),
            "rel_err_sum": rel}


def shares(counts: dict) -> dict:
    n = max(counts["n"], 1)
    kept = max(counts["n"] - counts["zero"] - counts["overflow"], 1)
    return {"values": counts["n"], "flushed_to_zero": counts["zero"] / n, "subnormal": counts["subnormal"] / n,
            "overflow": counts["overflow"] / n, "mean_rel_error": counts["rel_err_sum"] / kept}


def _add(total: dict, part: dict) -> None:
    for key, value in part.items():
        total[key] = total.get(key, 0) + value


def weight_table(model: torch.nn.Module) -> list[dict]:
    """The lesson's table: per parameter, its largest |value| and its fp16 / bf16 round-trip error."""
    rows = []
    for name, p in model.named_parameters():
        w = p.detach().float().flatten()
        nz = w[w != 0]
        row = {"name": name, "shape": list(p.shape), "numel": p.numel(),
               "max_abs": w.abs().max().item() if w.numel() else 0.0}
        for fmt, dtype in FORMATS.items():
            q = w.to(dtype).float()
            finite = torch.isfinite(q)
            err = (q - w).abs()[finite]
            c = cast_counts(nz, dtype)
            row[fmt] = {"max_abs_error": err.max().item() if err.numel() else 0.0,
                        "mean_rel_error": shares(c)["mean_rel_error"], "overflow": c["overflow"], "flushed": c["zero"]}
        rows.append(row)
    return rows


class GradientStats:
    """Streaming statistics of real gradients, batch after batch."""

    def __init__(self, chosen_scale: float):
        self.chosen = chosen_scale
        self.scales = sorted(set(SCALES) | {chosen_scale})
        self.fp16 = {s: {} for s in self.scales}
        self.bf16: dict = {}
        self.params: dict[str, dict] = {}
        self.hist = np.zeros(len(HIST_EDGES) - 1, dtype=np.int64)
        self.total = self.exact_zero = 0
        self.nearest = {d: None for d in DECADES}  # decade -> (distance in decades, value, parameter, index)
        self.decade_counts = {d: 0 for d in DECADES}

    def add(self, named_grads) -> None:
        for name, grad in named_grads:
            g = grad.detach().float().flatten()
            nonzero = g != 0
            v = g[nonzero]
            row = self.params.setdefault(name, {"max_abs": 0.0, "values": 0, "nonzero": 0, "zero@1": 0,
                                                "zero@chosen": 0, "overflow@chosen": 0})
            row["values"] += g.numel()
            row["nonzero"] += v.numel()
            self.total += g.numel()
            self.exact_zero += g.numel() - v.numel()
            if not v.numel():
                continue
            a = v.abs()
            row["max_abs"] = max(row["max_abs"], a.max().item())
            for s in self.scales:
                c = cast_counts(v, torch.float16, s)
                _add(self.fp16[s], c)
                if s == 1.0:
                    row["zero@1"] += c["zero"]
                if s == self.chosen:
                    row["zero@chosen"] += c["zero"]
                    row["overflow@chosen"] += c["overflow"]
            _add(self.bf16, cast_counts(v, torch.bfloat16))
            log = a.double().log10()
            self.hist += np.histogram(log.cpu().numpy(), bins=HIST_EDGES)[0]
            for d in DECADES:
                self.decade_counts[d] += int(((a >= d) & (a < 10 * d)).sum())
                dist = (log - math.log10(d)).abs()
                i = int(dist.argmin())
                if self.nearest[d] is None or dist[i].item() < self.nearest[d][0]:
                    index = int(nonzero.nonzero()[i])
                    self.nearest[d] = (dist[i].item(), v[i].item(), name, index)

    def max_abs(self) -> float:
        return max((r["max_abs"] for r in self.params.values()), default=0.0)

    def recommended_scale(self) -> float:
        """The largest power of two that leaves HEADROOM before any analysed gradient overflows fp16."""
        ok = [s for s in SCALES if s * HEADROOM in self.fp16 and self.fp16[s * HEADROOM].get("overflow", 0) == 0]
        return max(ok) if ok else min(SCALES)

    def demonstration(self, scale: float) -> list[dict]:
        """The lesson's 1e-6 ... 1e-9 values, each replaced by the model's real gradient value nearest to it."""
        rows = []
        for d in DECADES:
            if self.nearest[d] is None:
                continue
            dist, g, name, index = self.nearest[d]
            t = torch.tensor([g], dtype=torch.float32)
            plain, scaled = t.half().double().item(), ((t * scale).half().double() / scale).item()
            rows.append({"lesson_value": d, "gradient": g, "parameter": name, "index": index,
                         "values_in_decade": self.decade_counts[d], "fp16": plain,
                         "fp16_rel_error": abs(plain - g) / abs(g), "scale": scale, "fp16_scaled": scaled,
                         "fp16_scaled_rel_error": abs(scaled - g) / abs(g) if math.isfinite(scaled) else math.inf})
        return rows

    def histogram(self) -> dict:
        """Counts of log10 |gradient| in bins of 0.1, from the first to the last nonempty bin."""
        used = np.nonzero(self.hist)[0]
        if not len(used):
            return {"log10_edges": [], "counts": []}
        first, last = used[0], used[-1] + 1
        return {"log10_edges": HIST_EDGES[first:last + 1].round(2).tolist(), "counts": self.hist[first:last].tolist()}

    def summary(self, recommended: float) -> dict:
        at = {"unscaled": 1.0, "chosen": self.chosen, "recommended": recommended}
        return {
            "values": self.total, "exact_zeros": self.exact_zero, "max_abs": self.max_abs(),
            "fp16": {key: {"scale": s, **shares(self.fp16[s])} for key, s in at.items()},
            "fp16_by_scale": [{"scale": s, **shares(self.fp16[s])} for s in self.scales],
            "bf16": {"scale": 1.0, **shares(self.bf16)},
            "recommended_scale": recommended,
            "per_parameter": [{"name": n, **r, "zero@1_share": r["zero@1"] / max(r["nonzero"], 1),
                               "zero@chosen_share": r["zero@chosen"] / max(r["nonzero"], 1)}
                              for n, r in self.params.items()],
            "histogram": self.histogram(),
        }


def _tensors(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    if isinstance(output, dict):
        return [t for t in output.values() if isinstance(t, torch.Tensor)]
    return []


@contextlib.contextmanager
def activation_hooks(model: torch.nn.Module, stats: dict):
    """Forward hooks on every leaf module: largest |output| and |input|, and NaN/Inf outputs from finite inputs."""
    def hook(name):
        def fn(module, inputs, output):
            outs = [t.detach() for t in _tensors(output) if t.is_floating_point()]
            ins = [t.detach() for t in _tensors(inputs) if t.is_floating_point()]
            if not outs:
                return
            row = stats.setdefault(name, {"module": type(module).__name__, "shape": list(outs[0].shape),
                                          "dtype": str(outs[0].dtype).replace("torch.", ""), "max_abs": 0.0,
                                          "input_max_abs": 0.0, "nonfinite": 0, "nonfinite_from_finite_input": 0})
            finite_out = [torch.isfinite(t) for t in outs]
            bad = sum(int((~f).sum()) for f in finite_out)
            row["nonfinite"] += bad
            row["max_abs"] = max([row["max_abs"]] + [t[f].abs().max().item() for t, f in zip(outs, finite_out)
                                                      if f.any()] + ([math.inf] if bad else []))
            finite_in = all(bool(torch.isfinite(t).all()) for t in ins)
            if ins:
                row["input_max_abs"] = max([row["input_max_abs"]] + [t.abs().max().item() if finite_in else math.inf
                                                                      for t in ins if t.numel()])
            if bad and finite_in:
                row["nonfinite_from_finite_input"] += bad
        return fn

    leaves = [(n, m) for n, m in model.named_modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook(n or type(m).__name__)) for n, m in leaves]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()


class AutocastCheck:
    """The real batches under autocast(dtype), measured against the fp32 reference of the same batch: the
    loss, NaN/Inf per layer (forward hooks), and the gradients of one backward pass per loss scale, unscaled
    in fp32: how many nonzero reference values came out zero or NaN/Inf, and the relative error of the finite
    ones as a whole, ||g - g_fp32|| / ||g_fp32||."""

    def __init__(self, dtype: torch.dtype, scales: list[float]):
        self.dtype, self.scales = dtype, scales
        self.layers: dict = {}
        self.losses, self.ref_losses = [], []
        self.grads = {s: {} for s in scales}

    def add(self, model, batch, loss_fn, device, reference: dict, ref_loss: float) -> None:
        model.zero_grad(set_to_none=True)
        with activation_hooks(model, self.layers), torch.autocast(device_type=device.type, dtype=self.dtype):
            loss = loss_fn(model(batch["inputs"]), batch["labels"])
        self.losses.append(loss.item())
        self.ref_losses.append(ref_loss)
        for k, s in enumerate(self.scales):
            model.zero_grad(set_to_none=True)
            (loss * s).backward(retain_graph=k < len(self.scales) - 1)
            for name, p in model.named_parameters():
                if p.grad is None:
                    continue
                ref, got = reference[name], p.grad.float() / s
                ok, finite = ref != 0, torch.isfinite(got)
                _add(self.grads[s], {"n": int(ok.sum()), "zero": int((ok & (got == 0)).sum()),
                                     "nonfinite": int((~finite).sum()),
                                     "err_sq": (got - ref)[finite].double().pow(2).sum().item(),
                                     "ref_sq": ref[finite].double().pow(2).sum().item()})
        model.zero_grad(set_to_none=True)

    def result(self) -> dict:
        loss, ref = float(np.mean(self.losses)), float(np.mean(self.ref_losses))
        return {
            "loss": loss, "fp32_loss": ref,
            "loss_rel_diff": abs(loss - ref) / max(abs(ref), 1e-12) if math.isfinite(loss) else math.inf,
            "layers": self.layers,
            "gradients": [{"scale": s, "values": g.get("n", 0), "flushed_to_zero": g.get("zero", 0) / max(g.get("n", 0), 1),
                           "nonfinite": g.get("nonfinite", 0),
                           "rel_error": math.sqrt(g.get("err_sq", 0.0) / max(g.get("ref_sq", 0.0), 1e-300))}
                          for s, g in self.grads.items()],
        }
