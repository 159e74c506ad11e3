"""The precision report as console tables, a JSON file and a PNG histogram of gradient magnitudes."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from ..run_folder.checkpointing import write_atomic
from ..tables import json_safe, table
from .analysis import limits


def _g(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.3g}"


def _pct(x: float) -> str:
    return "0" if x == 0 else f"{x:.2%}" if x >= 1e-4 else f"{x:.1e}"


def _bytes(n) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def console(report: dict) -> str:
    meta, grads, out = report["meta"], report["gradients"], []
    out.append(f"precision report: {meta['model']} ({meta['num_parameters']:,} parameters, weights: {meta['weights']}) "
               f"on {meta['dataset']}, {meta['num_batches']} batches of {meta['batch_size']}, device {meta['device']}")

    out.append("\nweights: largest |value| and round-trip error (w -> fp16/bf16 -> fp32)")
    out.append(table(["parameter", "shape", "max |w|", "fp16 max err", "fp16 mean rel", "bf16 max err", "bf16 mean rel"],
                     [[w["name"], "x".join(map(str, w["shape"])), _g(w["max_abs"]), _g(w["fp16"]["max_abs_error"]),
                       _g(w["fp16"]["mean_rel_error"]), _g(w["bf16"]["max_abs_error"]), _g(w["bf16"]["mean_rel_error"])]
                      for w in report["weights"]]))

    zeros = grads["exact_zeros"] / max(grads["values"], 1)
    fp16 = limits(torch.float16)
    out.append(f"\ngradients: {grads['values']:,} values from {meta['num_batches']} batches ({_pct(zeros)} exactly zero, "
               f"left out below), largest |g| {_g(grads['max_abs'])}; fp16 keeps {fp16['min_subnormal']:.2g} to "
               f"{fp16['max']:g}, full precision from {fp16['min_normal']:.2g}")
    label = {"unscaled": "fp16, no loss scaling", "chosen": "fp16, the chosen loss scale {:g}",
             "recommended": "fp16, the recommended loss scale {:g}"}
    rows = [[label[key].format(s["scale"]), _pct(s["flushed_to_zero"]), _pct(s["subnormal"]),
             _pct(s["overflow"]), _g(s["mean_rel_error"])] for key, s in grads["fp16"].items()]
    b = grads["bf16"]
    rows.append(["bf16, no loss scaling", _pct(b["flushed_to_zero"]), _pct(b["subnormal"]), _pct(b["overflow"]),
                 _g(b["mean_rel_error"])])
    out.append(table(["cast to", "flushed to zero", "subnormal", "overflow", "mean rel err"], rows))
    chosen = grads["fp16"]["chosen"]["scale"]
    out.append(table(["parameter", "max |g|", "flushed, scale 1", f"flushed, scale {chosen:g}"],
                     [[p["name"], _g(p["max_abs"]), _pct(p["zero@1_share"]), _pct(p["zero@chosen_share"])]
                      for p in grads["per_parameter"]]))

    out.append(f"\nthe lesson's 1e-6 ... 1e-9, on this model's gradients: the real value nearest to each, through fp16 "
               f"without and with loss scale {chosen:g}")
    out.append(table(["lesson", "real gradient", "parameter[index]", "values in [x, 10x)", "fp16", "rel err",
                      f"fp16 x{chosen:g} / {chosen:g}", "rel err"],
                     [[f"{d['lesson_value']:g}", f"{d['gradient']:.4g}", f"{d['parameter']}[{d['index']}]",
                       f"{d['values_in_decade']:,}", f"{d['fp16']:.4g}", _pct(d["fp16_rel_error"]),
                       f"{d['fp16_scaled']:.4g}", _pct(d["fp16_scaled_rel_error"])] for d in report["demonstration"]]))

    out.append("\nautocast, measured: the same batches under fp16 / bf16 autocast against fp32 (backward at each loss "
               "scale, gradients unscaled in fp32)")
    rows = []
    for fmt, r in report["autocast"].items():
        for g in r["gradients"]:
            rows.append([fmt, f"{r['loss']:.5g} (fp32 {r['fp32_loss']:.5g})", _pct(r["loss_rel_diff"]), f"{g['scale']:g}",
                         _pct(g["flushed_to_zero"]), f"{g['nonfinite']:,}", _g(g["rel_error"])])
    out.append(table(["autocast", "loss", "loss rel diff", "loss scale", "grads flushed to zero", "grads NaN/Inf",
                      "grads rel err (norm)"], rows))

    out.append(f"\nactivations (forward hooks on every layer): largest |output|; fp16 overflows above {fp16['max']:g}")
    out.append(table(["layer", "module", "output shape", "max |out| fp32", "> fp16 max", "NaN/Inf fp16 autocast",
                      "NaN/Inf bf16 autocast"],
                     [[a["layer"], a["module"], "x".join(map(str, a["shape"])), _g(a["max_abs"]),
                       "starts here" if a["overflow_starts_here"] else "yes" if a["exceeds_fp16"] else "no",
                       f"{a['fp16_nonfinite']:,}", f"{a['bf16_nonfinite']:,}"] for a in report["activations"]]))

    out.append(f"\nmemory for one training step on one batch of {meta['batch_size']} (bytes of the storages allocated, "
               f"measured; AdamW state)")
    out.append(table(["format", "parameters", "gradients", "optimizer state", "activations", "total"],
                     [[m["format"], _bytes(m["parameters"]), _bytes(m["gradients"]), _bytes(m["optimizer_state"]),
                       _bytes(m["activations"]), _bytes(m["total"])] for m in report["memory"]]))

    out += fp8_console(report.get("fp8"))

    out.append("\nverdict:")
    out += [f"  - {line}" for line in report["verdict"]["lines"]]
    return "\n".join(out)


def _db(x: float) -> str:
    return f"{x:.1f}" if math.isfinite(x) else ("exact" if x > 0 else str(x))


def fp8_console(section: dict | None) -> list[str]:
    """The fp8 readiness tables: each Linear layer's operands through E4M3 / E5M2, its GEMMs, the exclusions."""
    if not section or not section["layers"]:
        return []
    from .fp8 import FORMATS, RECIPES, TENSORS

    out = [f"\nfp8 readiness per Linear layer: {section['simulated']}. Each operand through E4M3 and E5M2 with "
           f"{' / '.join(RECIPES)} scaling: SQNR of the round trip (dB), share of nonzero values flushed to zero, "
           f"share overflowing (saturated), share lost (flushed or saturated) in the worst channel (a weight's "
           f"output channel, an input's or output gradient's feature)"]
    headers = ["layer", "operand"]
    for fmt in FORMATS:
        headers += [f"{fmt.upper()} SQNR dB", f"{fmt.upper()} flushed", f"{fmt.upper()} overflow",
                    f"{fmt.upper()} worst channel lost"]
    rows = []
    for layer in section["layers"]:
        for tensor in TENSORS:
            row = [layer["layer"], tensor]
            for fmt in FORMATS:
                stats = [layer[tensor][fmt][r] for r in RECIPES]
                row += [" / ".join(_db(s["sqnr_db"]) for s in stats), " / ".join(_pct(s["flushed_to_zero"]) for s in stats),
                        " / ".join(_pct(s["overflow"]) for s in stats),
                        " / ".join(_pct(s.get("worst_channel_lost", 0.0)) for s in stats)]
            rows.append(row)
    out.append(table(headers, rows))
    out.append("\nfp8 GEMMs (torch._scaled_mm needs the inner and output dimensions divisible by 16)")
    out.append(table(["layer", "forward", "input gradient", "weight gradient", "not divisible by 16",
                      "Accelerate converts to fp8"],
                     [[r["layer"], r["gemms"]["forward"], r["gemms"]["input_gradient"], r["gemms"]["weight_gradient"],
                       ", ".join(r["not_divisible_by_16"]) or "-",
                       "yes" if r["accelerate_converts"] else f"no: {r['accelerate_leaves_out']}"]
                      for r in section["layers"]]))
    out.append(f"\nkeep out of fp8 ({section['judged_with']}; SQNR threshold {section['sqnr_threshold_db']:g} dB; "
               f"values lost above {section.get('lost_threshold', 0):.0%} of an operand or "
               f"{section.get('channel_lost_threshold', 0):.0%} of a weight's output channel):")
    out += [f"  {e['layer']}: {'; '.join(e['reasons'])}" for e in section["exclude"]]
    out.append(f"  as recipes/train.py's flag: {section['fp32_modules_flag']}")
    if section.get("launch"):
        out.append(f"  with Accelerate: {section['launch']}")
    return out


def write_json(report: dict, path: Path) -> None:
    write_atomic(path, json.dumps(json_safe(report), indent=1) + "\n")


def plot(report: dict, path: Path) -> None:
    """Histogram of log10 |gradient| (nonzero values), with and without the chosen loss scale, and the
    representable ranges of fp16 (normal and subnormal) and bf16."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grads = report["gradients"]
    edges = np.array(grads["histogram"]["log10_edges"])
    counts = np.array(grads["histogram"]["counts"], dtype=float)
    scale = grads["fp16"]["chosen"]["scale"]
    fp16, bf16 = limits(torch.float16), limits(torch.bfloat16)
    lo = min(edges[0] if len(counts) else -10, math.log10(fp16["min_subnormal"])) - 1
    hi = max(edges[-1] + math.log10(scale) if len(counts) else 0, math.log10(fp16["max"])) + 1

    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=100)
    ax.axvspan(10 ** lo, fp16["min_subnormal"], color="tab:red", alpha=0.08, label="fp16: flushed to zero")
    ax.axvspan(fp16["min_subnormal"], fp16["min_normal"], color="tab:orange", alpha=0.15,
               label=f"fp16 subnormal ({fp16['min_subnormal']:.2g} to {fp16['min_normal']:.2g}): precision lost")
    ax.axvspan(fp16["min_normal"], fp16["max"], color="tab:green", alpha=0.10,
               label=f"fp16 normal range (to {fp16['max']:g})")
    ax.axvspan(fp16["max"], 10 ** hi, color="tab:red", alpha=0.15, label="fp16: overflow to inf")
    for x, text in ((bf16["min_subnormal"], "bf16 smallest"), (bf16["max"], "bf16 largest")):
        if lo < math.log10(x) < hi:
            ax.axvline(x, color="tab:purple", linestyle="--")
    if len(counts):
        ax.stairs(counts, 10 ** edges, fill=True, color="tab:blue", alpha=0.7, label="|gradient| (fp32)")
        ax.stairs(counts, 10 ** (edges + math.log10(scale)), color="black", linewidth=1.2,
                  label=f"|gradient| x loss scale {scale:g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(10 ** lo, 10 ** hi)
    ax.set_ylim(0.8, max(counts.max(), 1) * 300)  # room for the legend above the bars
    ax.set_xlabel("|value|")
    ax.set_ylabel("gradient values per bin")
    meta = report["meta"]
    ax.set_title(f"{meta['model']} gradients, {meta['num_batches']} batches; bf16 keeps {bf16['min_subnormal']:.1e} "
                 f"to {bf16['max']:.1e} (beyond this axis)" if not lo < math.log10(bf16["max"]) < hi else
                 f"{meta['model']} gradients, {meta['num_batches']} batches", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
