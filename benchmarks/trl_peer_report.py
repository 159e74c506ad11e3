"""The report of benchmarks/trl_peer.py: the agreement of the loss curves, the step times, trl_peer.md."""
from __future__ import annotations

import statistics

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-3}  # the largest relative loss difference over a run, per precision


def pairs_of(report: dict, precision: str) -> list[dict]:
    return [r for r in report["rounds"] if r["precision"] == precision and "trl" in r and "recipe" in r]


def summarize(report: dict, args) -> None:
    """Per precision: the largest loss difference over every round's curves; step times and their ratios per
    round (TRL's step time / the recipe's: above 1, the recipe is faster)."""
    out = {}
    for precision in args.precisions:
        pairs = pairs_of(report, precision)
        if not pairs:
            continue
        worst = max((r["compare"] for r in pairs), key=lambda c: c["max_rel"])
        ratios = {key: [r["trl"][key] / r["recipe"][key] for r in pairs] for key in ("median_step_s", "p10_step_s")}
        out[precision] = {"max_abs": worst["max_abs"], "max_rel": worst["max_rel"], "at_step": worst["at_step"],
                          "grad_norm_max_rel": max(r["compare"]["grad_norm_max_rel"] for r in pairs),
                          "lr_max_rel": max(r["compare"]["lr_max_rel"] for r in pairs),
                          "tolerance_rel": TOLERANCE[precision], "within": worst["max_rel"] <= TOLERANCE[precision],
                          "recipe_step_s": statistics.median(r["recipe"]["median_step_s"] for r in pairs),
                          "trl_step_s": statistics.median(r["trl"]["median_step_s"] for r in pairs),
                          "speed_ratios": ratios["median_step_s"], "p10_ratios": ratios["p10_step_s"],
                          "speed_ratio_median": statistics.median(ratios["median_step_s"]),
                          "p10_ratio_median": statistics.median(ratios["p10_step_s"]),
                          "target_met": statistics.median(ratios["median_step_s"]) >= 0.97, "rounds": len(pairs),
                          "load_max": max(max(r["recipe"]["load"][0], r["trl"]["load"][0]) for r in pairs)}
    report["summary"] = out


def masks_line(masks: dict) -> str:
    if not masks:
        return "Token masks: not checked yet."
    return (f"Token masks: {masks['rows_checked']} rows in the order trained ({masks['targets_checked']:,} target "
            f"tokens), {masks['rows_differing']} differing between TRL's labels (from its assistant_masks) and the "
            f"recipe's.")


def tree_line(report: dict) -> str:
    changed = sorted({e.split()[-1] for r in report["rounds"] for e in (r.get("recipe") or {}).get("edits") or []})
    return (f"The recipe: commit {report['machine']['commit'][:10]}, " +
            (f"with uncommitted edits during its runs: {', '.join(changed)}" if changed else
             "no uncommitted edits to mixprec/ or recipes/train.py during its runs") + ".")


def rounding_line(report: dict) -> str:
    pairs = [r["compare"] for r in report["rounds"] if "compare" in r]
    if not pairs:
        return ""
    rounded = all(c["trl_loss_rounded_to_4"] for c in pairs)
    return ("TRL's logged loss: " + ("rounded to 4 decimals (differences below 5e-5 are rounding)" if rounded else
            "not rounded (transformers 5.25 logs the float; compared as it is)") + ".")


def markdown(report: dict, args) -> str:
    m, summary = report["machine"], report.get("summary", {})
    ms = lambda seconds: f"{seconds * 1e3:.1f} ms"  # noqa: E731
    lines = [f"# The recipe against TRL's SFTTrainer on chat data ({'complete' if report['complete'] else 'INCOMPLETE'})",
             "", f"{m['line']}; transformers {m['transformers']}, TRL {report.get('trl_version', '?')}; "
             f"{args.steps} steps; {args.repeats} interleaved rounds; batch {args.batch_size} x "
             f"{args.gradient_accumulation_steps} accumulated, {args.rows} conversations, block {report['block']}; "
             f"{report['date']}.", "", tree_line(report), "", rounding_line(report), "", masks_line(report["masks"]),
             "", "| precision | max loss diff | max relative | at step | tolerance (relative) | grad norm max relative |",
             "|---|---|---|---|---|---|"]
    for precision, s in summary.items():
        lines.append(f"| {precision} | {s['max_abs']:.2e} | {s['max_rel']:.2e} | {s['at_step']} | "
                     f"{s['tolerance_rel']:g} ({'met' if s['within'] else '**NOT met**'}) | {s['grad_norm_max_rel']:.2e} |")
    lines += ["", f"Step time (end of a step to the end of the next; median over the steps after the first "
              f"{args.warmup}, and the 10th percentile); ratio: the recipe's speed / TRL's (TRL's step time / the recipe's, "
              f"above 1: the recipe is faster), the "
              f"target 0.97; **busy** where a run began at a 1-minute load average above the {m['cores']} cores:",
              "", "| precision | recipe | TRL | ratio per round | median ratio | 10th-percentile ratio per round | median |",
              "|---|---|---|---|---|---|---|"]
    for precision, s in summary.items():
        busy = f" (load up to {s['load_max']:.1f}: **busy**)" if s["load_max"] > m["cores"] else ""
        lines.append(f"| {precision} | {ms(s['recipe_step_s'])} | {ms(s['trl_step_s'])} | "
                     f"{', '.join(f'{r:.2f}' for r in s['speed_ratios'])} | {s['speed_ratio_median']:.2f}"
                     f"{' (met)' if s['target_met'] else ' (below)'}{busy} | "
                     f"{', '.join(f'{r:.2f}' for r in s['p10_ratios'])} | {s['p10_ratio_median']:.2f} |")
    lines += ["", "| round | precision | order | recipe median / p10 | TRL median / p10 | load before recipe, TRL | "
              "threads recipe, TRL |", "|---|---|---|---|---|---|---|"]
    for precision in args.precisions:
        for r in pairs_of(report, precision):
            a, b = r["recipe"], r["trl"]
            lines.append(f"| {r['round']} | {precision} | {r['order']} | {ms(a['median_step_s'])} / {ms(a['p10_step_s'])} "
                         f"| {ms(b['median_step_s'])} / {ms(b['p10_step_s'])} | {a['load'][0]:.2f}, {b['load'][0]:.2f} | "
                         f"{a['threads']}, {b['threads']} |")
    for precision in args.precisions:
        first = (pairs_of(report, precision) or [None])[0]
        if first is None:
            continue
        lines += ["", f"Loss per step, {precision}, round {first['round']}:", "",
                  "| step | recipe | TRL | difference | recipe lr | TRL lr |", "|---|---|---|---|---|---|"]
        for i, (a, b) in enumerate(zip(first["recipe"]["loss"], first["trl"]["loss"])):
            lines.append(f"| {i + 1} | {a:.6f} | {b:.6f} | {abs(a - b):.1e} | {first['recipe']['lr'][i]:.3e} | "
                         f"{first['trl']['lr'][i]:.3e} |")
    lines += ["", f"Command: `python benchmarks/trl_peer.py {' '.join(report['argv'])}`", ""]
    return "\n".join(lines)
