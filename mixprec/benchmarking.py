"""What the benchmark scripts share: the machine they ran on, how busy it looked, and the report of repeated runs.

- `machine()`: machine_line(), the CPU flags that decide bf16/fp16 speed, threads, the load average.
- `LoadMeter`: the share of the machine's CPUs that other processes used while a run ran (Linux /proc/stat,
  minus this process and its finished children): a benchmark on a busy machine says so.
- `aggregate(runs, peaks)`: one row per precision x runner x variant from repeated runs: the median of the runs'
  median step times, their spread ((max - min) / median) and, where a peak FLOP/s is known, MFU.
- `paired`, `paired_median`, `rounds_table` (from mixprec.benchmark_rounds): one row's throughput over another's
  round by round: what recipes/benchmark.py's targets compare.
- `table`, `ratios`, `markdown`, `chart`: recipes/benchmark.py's benchmark.md and benchmark.png.
- `probed`, `add_probe`, `peaks_line`: the peak FLOP/s behind MFU, probed again after each round (the best
  probe counts), and the line of benchmark.md that names it.
- `log_window`, `loop_summary`: what the baseline loops (benchmarks/baselines/handwritten_loop.py, benchmarks/baselines/floor_loop.py) write,
  in the recipe's field names: a metrics.jsonl record and a console line per logging window, summary.json.
"""
from __future__ import annotations

import os
import resource
import statistics
import time
from pathlib import Path

from .benchmark_rounds import (LABEL, PRECISIONS, RUNNERS, paired, paired_difference,  # noqa: F401
                              paired_median, rounds, rounds_table)

VARIANTS = ("plain", "compile")
RELEVANT_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_AFFINITY", "GOMP_CPU_AFFINITY")
BUSY_SHARE = 0.10  # other processes using more than this share of the CPUs during a run: the machine was busy


def loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def machine() -> dict:
    """The machine as a benchmark reports it (call after setting the threads the runs will use)."""
    import torch

    from .devices.hardware import cpu_flags, cpu_native, machine_line, usable_cores
    out = {"machine": machine_line(), "usable_cores": usable_cores(), "torch_threads": torch.get_num_threads(),
           "thread_env": {k: os.environ[k] for k in THREAD_VARS if k in os.environ}, "loadavg_before": loadavg()}
    if not torch.cuda.is_available():
        out["cpu_flags"] = sorted(cpu_flags() & set(RELEVANT_FLAGS))
        out["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        for p in ("bf16", "fp16"):
            native, why = cpu_native(p)
            out[f"{p}_native"], out[f"{p}_why"] = native, why
    return out


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat (steal counts as busy)."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(values) - values[3] - values[4]) / hz, sum(values) / hz


def _own_cpu() -> float:
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


class LoadMeter:
    """Between construction and `stop()`: the share of all CPUs used by processes other than this one and its
    children (which must have been waited for), and the load average at the end."""

    def __init__(self):
        self.wall, self.times, self.own = time.monotonic(), _cpu_times(), _own_cpu()

    def stop(self) -> dict:
        times, wall = _cpu_times(), time.monotonic() - self.wall
        out = {"loadavg_after": loadavg(), "wall_s": wall}
        if times and self.times and wall > 0:
            busy = times[0] - self.times[0]
            cpus = max(1e-9, (times[1] - self.times[1]) / wall)  # CPUs counted in /proc/stat
            out["other_cpu_share"] = max(0.0, busy - (_own_cpu() - self.own)) / (wall * cpus)
        return out


def _find(results, precision, runner, variant="plain"):
    return next((x for x in results if (x["precision"], x["runner"], x.get("variant", "plain"))
                 == (precision, runner, variant)), None)


def throughput(x: dict) -> float:
    return x.get("tokens_per_s") or x["samples_per_s"]


def ratio(results, a: tuple, b: tuple, key: str | None = None) -> float | None:
    """Throughput (or `key`) of row a = (precision, runner[, variant]) over row b; None if either is missing."""
    x, y = _find(results, *a), _find(results, *b)
    if not x or not y:
        return None
    return (x[key] / y[key]) if key else throughput(x) / throughput(y)


def aggregate(runs: list[dict], peaks: dict) -> list[dict]:
    """One row per precision x runner x variant: medians over its runs; MFU where `peaks[precision]` has a peak."""
    keys = sorted({(r["precision"], r["runner"], r["variant"]) for r in runs},
                  key=lambda k: (PRECISIONS.index(k[0]), RUNNERS.index(k[1]), VARIANTS.index(k[2])))
    results = []
    for precision, runner, variant in keys:
        mine = [r for r in runs if (r["precision"], r["runner"], r["variant"]) == (precision, runner, variant)]
        times = [r["step_time_median_s"] for r in mine]
        step_time, first = statistics.median(times), mine[0]
        row = {"precision": precision, "runner": runner, "variant": variant, "runs": len(mine),
               "step_time_median_s": step_time, "step_time_runs_s": times,
               "spread": (max(times) - min(times)) / step_time, "samples_per_s": first["samples_per_step"] / step_time,
               "peak_memory_bytes": max(r["peak_memory_bytes"] for r in mine), "final_loss": first["final_loss"],
               "flops_per_sample": first.get("flops_per_sample"), "command": first["command"],
               "other_cpu_share_max": max((r.get("other_cpu_share") or 0.0) for r in mine)}
        if first.get("tokens_per_sample", 1) > 1:
            row["tokens_per_s"] = row["samples_per_s"] * first["tokens_per_sample"]
        if "peak_memory_reserved_bytes" in first:
            row["peak_memory_reserved_bytes"] = max(r["peak_memory_reserved_bytes"] for r in mine)
        peak = peaks.get(precision) or {}
        row["peak_flops"], row["peak_flops_source"] = peak.get("peak_flops"), peak.get("peak_flops_source")
        row["mfu"] = (row["samples_per_s"] * row["flops_per_sample"] / row["peak_flops"]
                      if row["peak_flops"] and row["flops_per_sample"] else None)
        results.append(row)
    return results


def probed(peak: dict) -> bool:
    """Whether `peak` was measured here (a matmul probe), not taken from a datasheet or --peak_flops."""
    return bool(peak.get("peak_flops")) and str(peak.get("peak_flops_source", "")).startswith("measured")


def add_probe(peak: dict, value: float) -> dict:
    """`peak` with one more probe of the same matmul: the best of all probes is the peak. A probe can only
    under-measure the hardware (a slow spell of a shared machine), so the best is the closest to its peak."""
    if not probed(peak) or not value or value <= 0:  # a fixed peak, or a probe that failed (metrics: None)
        return peak
    what = peak.get("probe_of") or peak["peak_flops_source"].rsplit(": ", 1)[-1]
    probes = [*(peak.get("probes") or [peak["peak_flops"]]), value]
    return {"peak_flops": max(probes), "probes": probes, "probe_of": what,
            "peak_flops_source": f"measured here: {what}, best of {len(probes)} probes (before the runs and after "
                                 f"each round)"}


def peaks_line(results: list[dict]) -> str | None:
    """The peak FLOP/s behind the MFU column, per precision, with where each came from."""
    seen = {}
    for r in results:
        if r.get("peak_flops"):
            seen.setdefault(LABEL[r["precision"]], f"{r['peak_flops'] / 1e12:.3g} TFLOP/s ({r['peak_flops_source']})")
    return "Peak FLOP/s for MFU: " + "; ".join(f"{p} {v}" for p, v in seen.items()) + "." if seen else None


MFU_ABOVE_100 = ("MFU above 100%: the runs did more work per second than the best probe of the peak, because the "
                 "machine's speed drifted between the probes and the runs or the model's matmuls run faster than "
                 "the probe's 1024 x 1024 one. It says that the measured peak is low, not that a run beat the "
                 "hardware; `--peak_flops` gives the benchmark a known peak.")
MFU_ABOVE_GIVEN = ("MFU above 100% against a datasheet or `--peak_flops` peak: the runs did more work per second "
                   "than that peak allows, so the peak is wrong for this device (or the FLOPs a step counts are).")


def run_rates(row: dict) -> list[float]:
    """The throughput of each of a row's runs (the row's own is their median)."""
    return [throughput(row) * row["step_time_median_s"] / t for t in row.get("step_time_runs_s") or
            [row["step_time_median_s"]]]


def runner_label(r: dict) -> str:
    return r["runner"] + (", compiled" if r.get("variant") == "compile" else "")


def table(results: list[dict]) -> str:
    text = any("tokens_per_s" in r for r in results)
    lines = [f"| precision | runner | step time (median) | spread | {'tokens/s' if text else 'samples/s'} | MFU "
             f"| peak memory | final loss |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        memory = f"{r['peak_memory_bytes'] / 2**30:.2f} GiB"
        if "peak_memory_reserved_bytes" in r:
            memory += f" ({r['peak_memory_reserved_bytes'] / 2**30:.2f} reserved)"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
        lines.append(f"| {LABEL[r['precision']]} | {runner_label(r)} | {r['step_time_median_s'] * 1e3:,.1f} ms "
                     f"| {r['spread']:.1%} of {r['runs']} | {throughput(r):,.0f} | {mfu} | {memory} "
                     f"| {r['final_loss']:.4f} |")
    return "\n".join(lines)


def ratios(results: list[dict], runs: list[dict] = ()) -> dict:
    out = {}
    for p in PRECISIONS:  # the recipe (and with its checks off) against every runner after it, round by round
        for a in ("recipe", "recipe_checks_off"):
            for other in RUNNERS[RUNNERS.index(a) + 1:]:
                if values := paired(runs, (p, a), (p, other)):
                    out[f"{a}/{other} throughput, {LABEL[p]}, median of {len(values)} paired rounds"] = \
                        statistics.median(values)
    pairs = [("recipe", "handwritten"), ("recipe", "floor"), ("handwritten", "floor"), ("recipe", "accelerate"),
             ("accelerate", "handwritten"), ("hf_trainer", "recipe"),
             ("hf_trainer", "floor"), ("recipe", "hf_accelerate"), ("recipe", "hf_trainer")]
    for r in results:
        p, runner, v = r["precision"], r["runner"], r.get("variant", "plain")
        tail = ", compiled" if v == "compile" else ""
        for a, b in pairs:
            if runner == a and (value := ratio(results, (p, a, v), (p, b, v))) is not None:
                out[f"{a}/{b} throughput, {LABEL[p]}{tail}"] = value
        if runner == "recipe" and (own := paired_difference(runs, (p, "recipe"), (p, "accelerate"), v)) is not None:
            out[f"recipe - accelerate step time (ms), {LABEL[p]}{tail}"] = own * 1e3  # the recipe's own work, by rounds
        if p != "no" and _find(results, "no", runner, v):
            out[f"{LABEL[p]}/fp32 throughput, {runner}{tail}"] = ratio(results, (p, runner, v), ("no", runner, v))
            out[f"{LABEL[p]}/fp32 peak memory, {runner}{tail}"] = ratio(results, (p, runner, v), ("no", runner, v),
                                                                        "peak_memory_bytes")
        if v == "compile" and _find(results, p, runner):
            out[f"compiled/plain throughput, {runner}, {LABEL[p]}"] = ratio(results, (p, runner, v), (p, runner))
    return dict(sorted(out.items()))


def threads_line(m: dict, runs: list[dict]) -> str:
    """The CPU threads the runs used (each runner chooses as the recipe does, mixprec.devices.threads)."""
    counts = {}
    for r in runs:
        if r.get("cpu_threads"):
            counts.setdefault(r["runner"], set()).add(r["cpu_threads"])
    if not counts:  # a report of a benchmark that did not record them: the threads it measured its peak with
        return f"{m['torch_threads']} threads for the peak FLOP/s"
    if len(set().union(*counts.values())) == 1:
        n = next(iter(next(iter(counts.values()))))
        return f"{n} thread{'s' if n > 1 else ''} per run"
    return "threads per run: " + ", ".join(f"{runner} {'/'.join(map(str, sorted(n)))}" for runner, n in counts.items())


def describe_machine(m: dict, runs: list[dict], threads: bool = True) -> str:
    """One line: the runs' threads (unless the report's rows say them), the bf16/fp16 flags, the load average
    before and after, and whether it looked busy."""
    parts = [threads_line(m, runs)] if threads else []
    if m.get("thread_env"):
        parts.append(" ".join(f"{k}={v}" for k, v in m["thread_env"].items()))
    if "cpu_flags" in m:
        kind = {p: "native" if m[f"{p}_native"] else "emulated" for p in ("bf16", "fp16")}
        parts.append(f"CPU flags {' '.join(m['cpu_flags']) or 'none of interest'} (bf16 {kind['bf16']}, "
                     f"fp16 {kind['fp16']})")
    shares = [r["other_cpu_share"] for r in runs if r.get("other_cpu_share") is not None]
    after = m.get("loadavg_after")
    parts.append(f"load average {m['loadavg_before'][0] if m.get('loadavg_before') else 'n/a'} before, "
                 f"{after[0] if after else 'n/a'} after")
    if shares:
        busy = max(shares) > BUSY_SHARE
        parts.append(f"other processes used up to {max(shares):.0%} of the CPUs during a run: "
                     f"{'**the machine looked busy**' if busy else 'the machine looked idle'}")
    return "; ".join(parts)


def subject(config: str, extra_flags: list[str]) -> str:
    """The config's name, and the model folder where a flag replaced the config's model (the last given, as
    argparse takes it): the transformers peers' tables of two models from one config must say which model each is."""
    name = Path(config).stem
    for flag in ("--model_name_or_path", "--config_name"):
        given = [extra_flags[i + 1] for i, f in enumerate(extra_flags[:-1]) if f == flag]
        given += [f.split("=", 1)[1] for f in extra_flags if f.startswith(flag + "=")]
        if given:
            return f"{name} with {flag} {given[-1]}"
    return name


def markdown(report: dict, command: str) -> str:
    r = report
    state = "" if r.get("complete") else f" (INCOMPLETE: {len(r['runs'])} of {r['planned_runs']} runs so far)"
    title = (f"{subject(r['config'], r.get('extra_flags') or [])}, {r['steps']} steps after {r['warmup']} warm-up, median of {r['repeats']} "
             f"interleaved runs{state}; {r['hardware']}")
    lines = [f"**{title}**", "", table(r["results"]), "", f"Machine: {describe_machine(r['machine'], r['runs'])}.", ""]
    if per_round := rounds_table(r["runs"]):
        order = ", the order rotated by one each round" if r.get("order") == "rotated" else \
            ", in the same order every round"
        lines += [f"Round by round (each round runs every row once, in turn{order}; the recipe's throughput over "
                  "each other runner's in the same round):", "", per_round, ""]
    lines += [f"- {k}: {v:+.3f}" if "(ms)" in k else f"- {k}: {v:.3f}x" if "paired" in k else f"- {k}: {v:.2f}x"
              for k, v in r["ratios"].items()]
    for t in r["targets"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["passed"]]
        value = "n/a" if t["value"] is None else f"{t['value']:.3g}"
        lines.append(f"- target: {t['target']}: {value} (bound {t['bound']:g}): **{verdict}**")
    lines += ["", "Spread: (slowest - fastest) / median of the runs' median step times. MFU n/a: no peak FLOP/s "
              "for that precision here (bf16/fp16 emulated on this CPU, or unknown)."]
    if peaks := peaks_line(r["results"]):
        lines += ["", peaks]
    above = [row for row in r["results"] if (row.get("mfu") or 0) > 1]
    if any(probed(row) for row in above):
        lines += ["", MFU_ABOVE_100]
    if any(not probed(row) for row in above):
        lines += ["", MFU_ABOVE_GIVEN]
    lines += ["", "Command:", "", f"    {command}"]
    return "\n".join(lines) + "\n"


def chart(results: list[dict], path: Path, title: str) -> None:
    """Throughput and peak memory, one bar per runner and precision; on the throughput bars a line from the
    slowest to the fastest run (the spread); the legend below the panels, where it hides no bar."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    precisions = [p for p in PRECISIONS if any(r["precision"] == p for r in results)]
    series = list(dict.fromkeys((r["runner"], r.get("variant", "plain")) for r in results))
    fig = Figure(figsize=(11, 4.6))
    axes = fig.subplots(1, 2)
    width = 0.8 / len(series)
    for i, (runner, variant) in enumerate(series):
        xs = [j + i * width for j in range(len(precisions))]
        rows = [_find(results, p, runner, variant) for p in precisions]
        label = runner_label({"runner": runner, "variant": variant})
        heights = [throughput(r) if r else 0 for r in rows]
        rates = [run_rates(r) if r else [0] for r in rows]
        axes[0].bar(xs, heights, width, label=label, capsize=2, error_kw={"elinewidth": 0.8, "ecolor": "0.2"},
                    yerr=[[h - min(x) for h, x in zip(heights, rates)], [max(x) - h for h, x in zip(heights, rates)]])
        axes[1].bar(xs, [r["peak_memory_bytes"] / 2**30 if r else 0 for r in rows], width, label=label)
    unit = "tokens/s" if any("tokens_per_s" in r for r in results) else "samples/s"
    for ax, ylabel in zip(axes, (f"throughput ({unit}, median step; line: slowest to fastest run)",
                                 "peak memory (GiB)")):
        ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(precisions))],
                      [LABEL[p] for p in precisions])
        ax.set_ylabel(ylabel, fontsize=8)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(series), 4), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout(rect=(0, 0.06 * ((len(series) + 3) // 4), 1, 1))
    fig.savefig(path, dpi=100)


def log_window(log, step: int, mean_loss: float, steps: int, elapsed: float, samples_per_step: int,
               tokens_per_sample: int, loss_scale: float | None) -> None:
    """One logging window of a baseline loop: a metrics.jsonl record (open file `log`) and a console line."""
    import json

    record = {"step": step, "loss": mean_loss, "step_time_s": elapsed / steps,
              "samples_per_s": steps * samples_per_step / elapsed}
    if tokens_per_sample > 1:
        record["tokens_per_s"] = record["samples_per_s"] * tokens_per_sample
    if loss_scale is not None:
        record["loss_scale"] = loss_scale
    log.write(json.dumps(record) + "\n")
    log.flush()
    print(f"step {step}, Loss: {mean_loss:.4f}, {record['step_time_s'] * 1e3:.1f} ms/step", flush=True)


def loop_summary(out: Path, steps: int, train_loss: float, precision: str, samples_per_step: int,
                 grad_scaler: bool, started: float, cost: dict, memory: dict) -> dict:
    """A baseline loop's summary.json, written and returned."""
    import json

    import torch

    summary = {"steps": steps, "train_loss": train_loss, "effective_precision": precision,
               "samples_per_step": samples_per_step, "grad_scaler": grad_scaler,
               "wall_time_s": time.perf_counter() - started, "cpu_threads": torch.get_num_threads(), **cost,
               **memory}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def baseline_model(cfg, device) -> tuple:
    """What the baseline loops (benchmarks/baselines/handwritten_loop.py, accelerate_loop.py) set up as the recipe
    does: the seed, the data, the model, its FLOPs per sample, the recipe's CPU threads and speed options.
    Returns (bundle, model, cost); the model is not moved to the device."""
    import torch

    from . import data, metrics, models
    from .devices import hardware
    from .training import speed

    torch.manual_seed(cfg.seed)
    bundle = data.build(cfg)
    model = models.build(cfg.model, bundle.info, cfg.model_args)
    cost = metrics.training_cost(model, bundle.train[0]["inputs"], bundle.info)
    if device.type == "cpu":  # the recipe's choice of threads (mixprec.devices.threads)
        hardware.set_cpu_threads(cfg.cpu_threads, cost["flops_per_sample"] * cfg.batch_size / 1e9)
    speed.apply(cfg.speed, cfg, model, device)  # the same compile / TF32 / activation checkpointing as the recipe
    return bundle, model, cost
