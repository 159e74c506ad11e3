"""Parity bands: is a precision as good as fp32 on this model and data? The statistics of recipes/parity.py.

The fp32 band, per evaluation point t (each --eval_steps step): the n fp32 seeds' validation losses give a mean
m_t and a sample standard deviation s_t. A precision run over m seeds has a mean curve u_t; it stays inside
when |u_t - m_t| <= h_t at every point, with

    h_t = q * s_t * sqrt(1/n + 1/m),   q = Student's t quantile, n - 1 degrees of freedom, at 1 - alpha / (2 E)

E the number of points (Bonferroni): a precision whose runs are fp32's in all but noise leaves the band at any
point with probability at most alpha (0.01 by default), if the seeds' losses are normal at each point and the
precision's seed-to-seed spread is fp32's. The mean over seeds, not each seed, is checked: the question is a
systematic shift, and m seeds each checked would multiply the false alarms. h_t is at least `floor` times m_t
(default 0.1%), so that points where the seeds nearly agree do not call rounding noise a shift.

The final validation loss's difference from fp32 gets a 95% confidence interval: paired over seeds where the
precision ran the fp32 runs' seeds (the same data, initialisation and order: the difference is the precision's
alone), else Welch's. The t quantiles come from Student's distribution computed here (the regularised
incomplete beta function), so that scipy is not needed.

A precision whose run skipped every optimizer step in some seed (fp16's GradScaler on activations beyond fp16's
range: every step overflows) did not train there, and is not inside whatever its loss: at a fine-tuning learning
rate the untouched model can sit inside the band. Skipped steps short of all are counted, not judged.
"""
from __future__ import annotations

import functools
import math
import platform
import statistics
from dataclasses import dataclass, field

from .devices.hardware import cpu_flags


def _beta_cf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return result


def beta_inc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_cf(a, b, x) / a
    return 1.0 - front * _beta_cf(b, a, 1.0 - x) / b


def t_cdf(x: float, df: float) -> float:
    tail = 0.5 * beta_inc(df / 2.0, 0.5, df / (df + x * x))
    return 1.0 - tail if x > 0 else tail


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, df: float) -> float:
    """Student's t quantile: the x with P(T <= x) = p, for 0.5 <= p < 1 (bisection on t_cdf)."""
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(64):  # far below double precision's resolution of the answer
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2.0


def interval(diffs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the t interval of a mean from its sample (a paired difference)."""
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, -math.inf, math.inf
    half = t_quantile(0.5 + level / 2, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return mean, mean - half, mean + half


def welch(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high): Welch's t interval with the Welch-Satterthwaite degrees of freedom."""
    diff = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return diff, -math.inf, math.inf
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return diff, diff, diff
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = t_quantile(0.5 + level / 2, df) * math.sqrt(va + vb)
    return diff, diff - half, diff + half


@dataclass
class Band:
    """The fp32 band: per evaluation step, the fp32 seeds' validation losses (`values[i][j]`: step i, seed j)."""

    steps: list[int]
    seeds: list[int]
    values: list[list[float]]
    alpha: float = 0.01
    floor: float = 0.001

    @property
    def n(self) -> int:
        return len(self.seeds)

    @functools.cached_property
    def mean(self) -> list[float]:
        return [math.fsum(v) / len(v) for v in self.values]

    @functools.cached_property
    def std(self) -> list[float]:  # the sample standard deviation (n - 1)
        return [math.sqrt(math.fsum((x - m) ** 2 for x in v) / (len(v) - 1)) for v, m in zip(self.values, self.mean)]

    @property
    def q(self) -> float:
        return t_quantile(1 - self.alpha / (2 * len(self.steps)), self.n - 1)

    def half_width(self, m: int) -> list[float]:
        """h_t for the mean of m seeds of another precision."""
        return [max(self.q * s * math.sqrt(1 / self.n + 1 / m), self.floor * abs(mu))
                for s, mu in zip(self.std, self.mean)]

    def final(self) -> dict[int, float]:
        return dict(zip(self.seeds, self.values[-1]))

    def to_dict(self, m: int) -> dict:
        return {"steps": self.steps, "seeds": self.seeds, "values": self.values, "alpha": self.alpha,
                "floor": self.floor, "n": self.n, "q": self.q, "mean": self.mean, "std": self.std,
                "checked_seeds": m, "half_width": self.half_width(m)}

    @classmethod
    def from_dict(cls, data: dict) -> Band:
        return cls([int(s) for s in data["steps"]], [int(s) for s in data["seeds"]],
                   [[float(x) for x in v] for v in data["values"]], float(data["alpha"]), float(data["floor"]))


def band_from_curves(curves: dict[int, dict[int, float]], alpha: float, floor: float) -> Band:
    """The band from fp32's curves ({seed: {step: val_loss}}) at the steps every seed evaluated."""
    seeds = sorted(curves)
    steps = sorted(set.intersection(*(set(curves[s]) for s in seeds)))
    return Band(steps, seeds, [[curves[s][t] for s in seeds] for t in steps], alpha, floor)


@dataclass
class Verdict:
    name: str
    seeds: list[int]
    steps: list[int]
    mean: list[float]  # the mean curve at the band's steps (NaN where a seed has no finite value)
    half_width: list[float]
    diff: list[float]  # mean - band mean
    outside: list[dict] = field(default_factory=list)  # {"step", "diff", "half_width", "by"}
    final: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)  # {seed: [skipped optimizer steps, optimizer steps]}, where known

    @property
    def untrained(self) -> list[int]:
        """The seeds whose run skipped every one of its optimizer steps."""
        return [s for s in self.seeds if s in self.skipped and 0 < self.skipped[s][1] <= self.skipped[s][0]]

    @property
    def inside(self) -> bool:
        return not self.outside and not self.untrained

    def skips(self) -> tuple[int, int]:
        """(skipped, all) optimizer steps over the seeds whose counts are known."""
        return sum(k for k, _ in self.skipped.values()), sum(n for _, n in self.skipped.values())

    def not_trained(self) -> str:
        """'not trained (every optimizer step skipped in 5 of 5 seeds)', or ''."""
        return (f"not trained (every optimizer step skipped in {len(self.untrained)} of {len(self.seeds)} seeds)"
                if self.untrained else "")

    def where(self) -> str:
        """The points outside as one phrase: 'step 200: +0.031 against +/-0.012 (0.019 beyond)', after
        'not trained (...)' where a seed skipped every step."""
        return "; ".join([*filter(None, [self.not_trained()]),
                          *(f"step {p['step']}: {p['diff']:+.4g} against +/-{p['half_width']:.3g}"
                            + (f" ({p['by']:.3g} beyond)" if math.isfinite(p["by"]) else " (no finite loss)")
                            for p in self.outside)])

    def to_dict(self) -> dict:
        return {"seeds": self.seeds, "mean": self.mean, "diff": self.diff, "half_width": self.half_width,
                "inside": self.inside, "outside": self.outside, "final": self.final,
                "skipped_steps": {str(s): v for s, v in self.skipped.items()}, "untrained_seeds": self.untrained}


def verdict(name: str, curves: dict[int, dict[int, float]], band: Band,
            skipped: dict[int, tuple[int, int]] | None = None) -> Verdict:
    """Is the mean over `curves`' seeds inside `band` at each of its steps, and the final difference's interval.
    `skipped`: {seed: (skipped optimizer steps, optimizer steps)} of the runs (a seed that skipped all is not
    trained, so not inside)."""
    seeds = sorted(curves)
    widths = band.half_width(len(seeds))
    mean = []
    for t in band.steps:
        values = [curves[s].get(t, math.nan) for s in seeds]
        mean.append(statistics.fmean(values) if all(math.isfinite(v) for v in values) else math.nan)
    diff = [u - m for u, m in zip(mean, band.mean)]
    result = Verdict(name, seeds, band.steps, mean, widths, diff,
                     skipped={s: [int(k), int(n)] for s, (k, n) in (skipped or {}).items() if s in curves})
    for t, d, h in zip(band.steps, diff, widths):
        if not abs(d) <= h:  # NaN is outside
            result.outside.append({"step": t, "diff": d, "half_width": h, "by": abs(d) - h})
    result.final = final_difference(curves, band)
    return result


def final_difference(curves: dict[int, dict[int, float]], band: Band) -> dict:
    """The final validation loss against fp32's: paired over shared seeds where every seed of the precision has an
    fp32 run of the same seed, else Welch's; with its 95% interval, absolute and relative to fp32's mean."""
    last, fp32 = band.steps[-1], band.final()
    mine = {s: c.get(last, math.nan) for s, c in curves.items()}
    if not all(math.isfinite(v) for v in mine.values()):
        return {"method": "none: a run has no finite final validation loss", "step": last}
    if set(mine) <= set(fp32) and len(mine) >= 2:
        mean, low, high = interval([mine[s] - fp32[s] for s in sorted(mine)])
        method = f"paired t over {len(mine)} seeds"
    else:
        mean, low, high = welch(list(mine.values()), list(fp32.values()))
        method = f"Welch's t, {len(mine)} against {len(fp32)} fp32 seeds"
    base = statistics.fmean(fp32.values())
    return {"method": method, "step": last, "val_loss": statistics.fmean(mine.values()), "fp32_val_loss": base,
            "diff": mean, "low": low, "high": high, "relative": mean / base, "relative_low": low / base,
            "relative_high": high / base}


def cpu_kind() -> str:
    """A short name for the CPU's family and its bf16 support: intel-amx, amd-avx512bf16, amd-avx2, ..."""
    from .devices.hardware import cpu_name

    name = cpu_name().lower()
    vendor = "intel" if "intel" in name or "xeon" in name else "amd" if "amd" in name else platform.machine()
    flags = cpu_flags()
    feature = ("amx" if "amx_bf16" in flags else "avx512bf16" if "avx512_bf16" in flags
               else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other")
    return f"{vendor}-{feature}"


def table(verdicts: list[Verdict], reference: str | None) -> list[str]:
    """The printed and committed table: one row per precision; the worst point is the one furthest out of the
    band relative to its half-width (the first without a finite loss, if any)."""
    lines = ["| precision | seeds | inside the fp32 band | worst point: mean - fp32 (band half-width) | "
             "final val loss | vs fp32, 95% interval |", "|---|---|---|---|---|---|"]
    for v in verdicts:
        f = v.final
        if v.name == reference:
            status, compare = "the band (reference)", "-"
        else:
            parts = [v.not_trained()] if v.untrained else []
            if v.outside:
                parts.append(f"{len(v.outside)} of {len(v.diff)} points")
            status = "yes" if v.inside else "NO: " + "; ".join(parts)
            skipped, steps = v.skips()
            if skipped and not v.untrained:
                status += f" ({skipped:,} of {steps:,} optimizer steps skipped)"
            compare = (f"{f['diff']:+.4f} [{f['low']:+.4f}, {f['high']:+.4f}] ({f['relative']:+.2%}; "
                       f"{f['method']})" if "diff" in f else f["method"])
        i = max(range(len(v.diff)), key=lambda j: math.inf if not math.isfinite(v.diff[j])
                else abs(v.diff[j]) / v.half_width[j])
        point = "-" if v.name == reference else f"{v.diff[i]:+.4f} (+/-{v.half_width[i]:.4f}) at step {v.steps[i]}"
        final = f"{f['val_loss']:.4f}" if "val_loss" in f else "-"
        lines.append(f"| {v.name} | {len(v.seeds)} | {status} | {point} | {final} | {compare} |")
    return lines
