"""Runs of one round compared with each other (recipes/benchmark.py's targets and benchmark.md's round table).

A round runs every row once, in turn, minutes apart: its runs share the machine's slow drifts, which the rows'
medians over all rounds do not cancel, and "the faster of two peers" taken from two noisy medians favours the
peers. So one row's throughput over another's is taken round by round (`paired`), then the median over the
rounds (`paired_median`); `rounds_table` shows every round.
"""
from __future__ import annotations

import statistics

PRECISIONS = ("no", "fp16", "bf16", "fp8")
LABEL = {"no": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8"}
RUNNERS = ("recipe", "recipe_checks_off", "handwritten", "floor", "accelerate", "hf_accelerate", "hf_trainer")


def rounds(runs: list[dict], variant: str = "plain") -> dict[int, dict[tuple[str, str], float]]:
    """Each round's (repeat's) median step time of every (precision, runner) that ran in it."""
    out = {}
    for r in runs:
        if r.get("variant", "plain") == variant:
            out.setdefault(r["repeat"], {})[r["precision"], r["runner"]] = r["step_time_median_s"]
    return dict(sorted(out.items()))


def paired(runs: list[dict], a: tuple[str, str], b: tuple[str, str], variant: str = "plain") -> list[float]:
    """Throughput of a = (precision, runner) over b's in each round both ran in (b's step time / a's)."""
    return [t[b] / t[a] for t in rounds(runs, variant).values() if a in t and b in t]


def paired_median(runs: list[dict], a: tuple[str, str], b: tuple[str, str], variant: str = "plain") -> float | None:
    """The median over the rounds of `paired`; None where no round ran both."""
    values = paired(runs, a, b, variant)
    return statistics.median(values) if values else None


def paired_difference(runs: list[dict], a: tuple[str, str], b: tuple[str, str], variant: str = "plain") -> float | None:
    """a's step time minus b's in the same round, the median over the rounds (seconds); None where none ran both."""
    diffs = [t[a] - t[b] for t in rounds(runs, variant).values() if a in t and b in t]
    return statistics.median(diffs) if diffs else None


def _ms(seconds: float) -> str:
    """A step time in ms: whole ms from 100 ms, else 4 significant digits (the MLP's steps take about 1 ms)."""
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.4g}"


def rounds_table(runs: list[dict], variant: str = "plain") -> str | None:
    """Round by round, each runner's step time and the recipe's throughput over each other runner's in that round,
    per precision; None with one round or no recipe beside another runner."""
    by_round = rounds(runs, variant)
    precisions = [p for p in PRECISIONS if any(k[0] == p for t in by_round.values() for k in t)]
    runners = [r for r in RUNNERS if any(k[1] == r for t in by_round.values() for k in t)]
    others = [r for r in runners if r != "recipe"]
    if len(by_round) < 2 or "recipe" not in runners or not others:
        return None
    head = ["precision", "round", *(f"{r} (ms)" for r in runners), *(f"recipe/{r}" for r in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in precisions:
        for k, t in by_round.items():
            times = [_ms(t[p, r]) if (p, r) in t else "-" for r in runners]
            shares = [f"{t[p, r] / t[p, 'recipe']:.3f}" if (p, r) in t and (p, "recipe") in t else "-"
                      for r in others]
            lines.append(f"| {LABEL[p]} | {k} | " + " | ".join(times + shares) + " |")
    return "\n".join(lines)
