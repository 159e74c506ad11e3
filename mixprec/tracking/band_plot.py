"""parity.png: the fp32 band and each precision's mean validation-loss curve (recipes/parity.py), drawn with
matplotlib without a display, in metrics.png's style (mixprec.tracking.plots).

Two panels: the validation loss (the band shaded around fp32's mean, each precision's mean over its seeds, the
fp32 seeds thin), and each precision's difference from fp32's mean with the band's half-width shaded around
zero, where a small shift is visible. Points outside the band are marked with a red x.
"""
from __future__ import annotations

import math
from pathlib import Path

from .plots import save_png

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive")
STYLES = ("-", "--", ":", "-.")  # curves inside the band lie on one another: told apart by their dashes


def _finite(xs: list, ys: list) -> tuple[list, list]:
    pairs = [(x, y) for x, y in zip(xs, ys) if isinstance(y, (int, float)) and math.isfinite(y)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_bands(result: dict, path: Path) -> Path:
    """Draw the parity result (recipes/parity.py's parity.json as a dict) into `path`, atomically."""
    from matplotlib.figure import Figure

    band = result["band"]
    steps, mean, half = band["steps"], band["mean"], band["half_width"]
    fig = Figure(figsize=(14, 5.5), dpi=90)
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.1, top=0.86, wspace=0.18)
    loss, shift = fig.subplots(1, 2)
    label = (f"fp32 band: mean of {band['n']} seeds +/- t * s * sqrt(1/{band['n']} + 1/{band['checked_seeds']}),"
             f" alpha {band['alpha']:g}")
    loss.fill_between(steps, [m - h for m, h in zip(mean, half)], [m + h for m, h in zip(mean, half)],
                      color="0.8", label=label)
    shift.fill_between(steps, [-h for h in half], half, color="0.8", label="the band's half-width")
    shift.axhline(0.0, color="0.5", linewidth=0.8)
    for seed_values in zip(*band["values"]):
        loss.plot(*_finite(steps, list(seed_values)), color="0.55", linewidth=0.6)
    for i, (name, precision) in enumerate(result["precisions"].items()):
        n, color, style = len(precision["seeds"]), COLORS[i % len(COLORS)], STYLES[i % len(STYLES)]
        untrained = len(precision.get("untrained_seeds") or [])  # every step skipped (mixprec.parity)
        what = f"mean of {n}" + (f"; NOT TRAINED in {untrained} of {n}: every step skipped" if untrained else "")
        for ax, ys in ((loss, precision["mean"]), (shift, precision["diff"])):
            ax.plot(*_finite(steps, ys), marker="o", markersize=3, color=color, linestyle=style, linewidth=1.8,
                    label=f"{name} ({what})")
        out = [(p["step"], p["diff"]) for p in precision["outside"] if math.isfinite(p["diff"])]
        if out:
            shift.plot([p[0] for p in out], [p[1] for p in out], "x", color="tab:red", markersize=9)
            mean_at = dict(zip(steps, precision["mean"]))
            loss.plot([p[0] for p in out], [mean_at[p[0]] for p in out], "x", color="tab:red", markersize=9)
    loss.set_title("validation loss (thin grey: each fp32 seed)")
    shift.set_title("mean validation loss - fp32's mean (red x: outside the band)")
    for ax in (loss, shift):
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{result['title']}\n{result['machine']}", fontsize="medium")
    return save_png(fig, path)
