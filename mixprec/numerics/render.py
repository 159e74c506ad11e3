"""The precision diff as diff.json, diff.md (worst modules first), diff.png (error by module in forward order,
one line per step) and a console table. Every output says how each precision was computed (simulated or
real) and on what hardware."""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..run_folder.checkpointing import write_atomic
from ..tables import json_safe, table


def label(name: str) -> str:
    """A precision's name for people: 'no' is fp32."""
    return "fp32" if name == "no" else name


def _e(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return "0" if x == 0 else f"{x:.2e}"


def _db(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "exact" if x > 0 else "NaN/Inf"
    return f"{x:.1f}"


def _last(values: list) -> dict | None:
    return next((v for v in reversed(values) if v), None)


def _worst(values: list) -> dict | None:
    present = [v for v in values if v]
    return min(present, key=lambda v: v["sqnr_db"]) if present else None


def module_table(result: dict) -> tuple[list[str], list[list[str]]]:
    """Headers and rows, worst module first."""
    headers = ["rank", "module", "type", "alone: rel err", "alone: SQNR dB", "output: rel err", "output: SQNR dB",
               "grad: rel err", "grad: SQNR dB"]
    rows = []
    for r in sorted(result["modules"], key=lambda r: r["rank"]):
        local, out, grad = _worst(r["local"]), _last(r["output"]), _last(r["grad"])
        rows.append([str(r["rank"]), r["module"], r["type"],
                     _e(local and local["rel_error"]), _db(local and local["sqnr_db"]),
                     _e(out and out["rel_error"]), _db(out and out["sqnr_db"]),
                     _e(grad and grad["rel_error"]), _db(grad and grad["sqnr_db"])])
    return headers, rows


def step_table(result: dict) -> tuple[list[str], list[list[str]]]:
    ref, oth = result["meta"]["compare"]
    headers = ["step", f"loss {label(ref)}", f"loss {label(oth)}", "difference", "rel diff", f"{label(oth)} step"]
    rows = []
    for s in result["steps"]:
        own = s[oth]
        note = "skipped (NaN/Inf gradients)" if own["skipped"] else "applied"
        if "loss_scale" in own:
            note += f", loss scale {own['loss_scale']:g}"
        rows.append([str(s["step"]), f"{s['loss'][ref]:.6g}", f"{s['loss'][oth]:.6g}", f"{s['loss_diff']:+.3e}",
                     _e(s["loss_rel_diff"]), note])
    return headers, rows


def header_lines(result: dict) -> list[str]:
    m = result["meta"]
    ref, oth = m["compare"]
    lines = [f"precision diff: {label(oth)} against {label(ref)} on {m['model']} ({m['num_parameters']:,} parameters, weights: "
             f"{m['weights']}), {m['dataset']}, {m['steps']} step{'s' if m['steps'] != 1 else ''} of batch {m['batch_size']}, same initial weights "
             f"and batches",
             f"  {label(ref)}: {m['how'][ref]}", f"  {label(oth)}: {m['how'][oth]}",
             f"  hardware: {m['hardware']}; {result['wall_time_s']:.1f} s"]
    if m["fp32_modules"]:
        lines.append("  --fp32_modules: " + "; ".join(f"{p!r} -> {', '.join(n)}" for p, n in m["fp32_modules"].items())
                     + " (fp32 in both runs)")
    fp8 = result.get("fp8_layers") or {}
    if fp8:
        kept = {n: why for n, why in fp8.items() if why}
        lines.append(f"  fp8: {len(fp8) - len(kept)} of {len(fp8)} Linear layers in fp8 ({m['fp8_recipe']} scales); "
                     f"not in fp8: " + (", ".join(f"{n} ({why}: {'fp32' if why == '--fp32_modules' else 'bf16'})"
                                                  for n, why in kept.items()) or "none"))
    ref, oth = label(ref), label(oth)
    lines.append(f"  alone = the module computed in {oth} on the {ref} run's input and weights (the error it introduces, "
                 f"worst step; ranks the modules); output / grad = the {oth} run against the {ref} run at the last step "
                 f"(errors from upstream and diverging weights included); 'exact' = no difference")
    return lines


def divergence_line(result: dict) -> str:
    w = result["weights"]["total"]
    return (f"weights after {result['meta']['steps']} steps: ||w - w_ref|| / ||w_ref|| = {_e(w['rel_divergence'])}, "
            f"{_e(w['divergence_over_update'])} of the reference's own update ||w_ref - w_0||")


def console(result: dict) -> str:
    out = header_lines(result)
    out += ["", "modules, worst first:", table(*module_table(result))]
    out += ["", "loss per step:", table(*step_table(result)), "", divergence_line(result)]
    return "\n".join(out)


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(result: dict) -> str:
    m = result["meta"]
    ref, oth = m["compare"]
    head = header_lines(result)
    out = [f"# Precision diff: {label(oth)} against {label(ref)}", "", head[0], "", *[f"- {h.strip()}" for h in head[1:]], "",
           f"Command: `{m['command']}`", "", "## Modules, worst first", "", _md_table(*module_table(result)), "",
           "## Loss per step", "", _md_table(*step_table(result)), "", divergence_line(result), "",
           "## Error each module introduces, per step (SQNR dB; module alone)", ""]
    steps = [s["step"] for s in result["steps"]]
    rows = [[r["module"], *[_db(x and x["sqnr_db"]) for x in r["local"]]] for r in result["modules"]]
    out += [_md_table(["module (forward order)", *[f"step {s}" for s in steps]], rows), ""]
    return "\n".join(out)


def write_json(result: dict, path: Path) -> None:
    write_atomic(path, json.dumps(json_safe(result), indent=1) + "\n")


def plot(result: dict, path: Path) -> None:
    """Two panels over the modules in forward order: the relative error of each module's output (second run
    against the reference), and of the module alone; one line per step. NaN/Inf is drawn at the top."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(result["modules"], key=lambda r: r["forward_index"])
    ref, oth = (label(p) for p in result["meta"]["compare"])
    x = list(range(len(rows)))
    fig, axes = plt.subplots(2, 1, figsize=(max(10, 0.22 * len(rows)), 8), dpi=100, sharex=True)
    finite = [v["rel_error"] for r in rows for kind in ("output", "local") for v in r[kind]
              if v and math.isfinite(v["rel_error"]) and v["rel_error"] > 0]
    top = max(finite, default=1.0) * 30
    bottom = min(finite, default=1e-8) / 3
    for ax, kind, title in ((axes[0], "output", f"{oth} run's output against the {ref} run's"),
                            (axes[1], "local", f"the module alone in {oth}, on the {ref} run's input and weights")):
        for k, step in enumerate(result["steps"]):
            ys = []
            for r in rows:
                v = r[kind][k] if k < len(r[kind]) else None
                ys.append(math.nan if v is None else top if not math.isfinite(v["rel_error"]) else
                          max(v["rel_error"], bottom))
            ax.plot(x, ys, marker="o", markersize=3, linewidth=1, label=f"step {step['step']}")
        ax.axhline(top, color="tab:red", linestyle=":", linewidth=1)
        ax.axhline(bottom, color="tab:gray", linestyle=":", linewidth=1)
        ax.text(len(rows) - 0.5, top, "NaN/Inf ", color="tab:red", va="bottom", ha="right", fontsize=8)
        ax.text(len(rows) - 0.5, bottom, "exact (0) ", color="tab:gray", va="bottom", ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylim(bottom / 2, top * 3)
        ax.set_ylabel("relative error")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="center left")
    axes[1].set_xticks(x)
    axes[1].set_xticklabels([r["module"] for r in rows], rotation=90, fontsize=7)
    how = "simulated" if result["meta"]["simulated"].get(result["meta"]["compare"][1]) else "real"
    fig.suptitle(f"{result['meta']['model']}: {oth} ({how}) against {ref}, modules in forward order; "
                 f"{result['meta']['hardware']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
