#!/usr/bin/env python
"""Precisions side by side, and the recipe against a hand-written loop, for one model and config.

    python recipes/benchmark.py --config recipes/configs/gpt_small.yaml --precisions no,bf16 \\
        --output_dir runs/bench-gpt_small --targets cpu

For each precision, in one invocation, with the same seed and number of steps: recipes/train.py (the
recipe: Accelerate) and recipes/handwritten_loop.py (the lesson's loop in plain PyTorch), each in its own
process. Both log the mean step time of every window of --log_every steps; the windows after --warmup
steps give the median step time, and from it samples/s (tokens/s for text) and MFU (one peak FLOP/s per
precision for both runners: the datasheet table on known GPUs, else a matmul benchmark measured here).
Peak memory: CUDA max allocated and reserved, or the CPU process's peak resident set. Flags the benchmark
does not know (--compile, --tf32, --batch_size, ...) go to both runners.

Writes DIR/benchmark.json (`results`: precision, runner, step_time_median_s, tokens_per_s or samples_per_s,
peak_memory_bytes, mfu, final_loss, ...), DIR/benchmark.md (the table, ratios and targets) and
DIR/benchmark.png; each run's own folder and log are under DIR/runs/.
Run it on an otherwise idle machine: timings take whatever else runs as their own.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mixprec.errors import UsageError, exit_on_usage_error

REPO = Path(__file__).resolve().parents[1]

RUNNERS = {"recipe": "recipes/train.py", "handwritten": "recipes/handwritten_loop.py"}
PRECISIONS = ("no", "fp16", "bf16", "fp8")
LABEL = {"no": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8"}
# (description, check(results) -> (value, passed) or None when the runs needed are missing)
TARGETS = {
    "cpu": [("recipe within 5% of the hand-written loop, fp32", lambda r: _ratio(r, "no", "recipe", "no", "handwritten"), 0.95),
            ("recipe within 5% of the hand-written loop, bf16", lambda r: _ratio(r, "bf16", "recipe", "bf16", "handwritten"), 0.95),
            ("bf16 at least 1.5x fp32 throughput (recipe)", lambda r: _ratio(r, "bf16", "recipe", "no", "recipe"), 1.5)],
    "h200": [("bf16 MFU at least 45% (recipe)", lambda r: _get(r, "bf16", "recipe", "mfu"), 0.45),
             ("bf16 at least 1.8x fp32+TF32 throughput (recipe)", lambda r: _ratio(r, "bf16", "recipe", "no", "recipe"), 1.8),
             ("bf16 peak memory at most 0.65x fp32 (recipe)",
              lambda r: _ratio(r, "bf16", "recipe", "no", "recipe", "peak_memory_bytes"), -0.65),
             ("fp16 + GradScaler within 5% of bf16 (recipe)", lambda r: _ratio(r, "fp16", "recipe", "bf16", "recipe"), 0.95),
             ("recipe at least 98% of the hand-written loop, bf16",
              lambda r: _ratio(r, "bf16", "recipe", "bf16", "handwritten"), 0.98)],
}


def _find(results, precision, runner):
    return next((x for x in results if x["precision"] == precision and x["runner"] == runner), None)


def _get(results, precision, runner, key):
    found = _find(results, precision, runner)
    return found.get(key) if found else None


def _throughput(x: dict) -> float:
    return x.get("tokens_per_s") or x["samples_per_s"]


def _ratio(results, p1, r1, p2, r2, key=None):
    a, b = _find(results, p1, r1), _find(results, p2, r2)
    if not a or not b:
        return None
    return (a[key] / b[key]) if key else _throughput(a) / _throughput(b)


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe config, e.g. recipes/configs/gpt_small.yaml")
    parser.add_argument("--precisions", default="no,bf16", help="comma-separated: no (fp32), fp16, bf16, fp8")
    parser.add_argument("--runners", default="recipe,handwritten", help="comma-separated: recipe, handwritten")
    parser.add_argument("--output_dir", default=None, help="default: runs/benchmark-<config>-<date>-<time>")
    parser.add_argument("--steps", type=int, default=30, help="measured optimizer steps per run (default: 30)")
    parser.add_argument("--warmup", type=int, default=10, help="steps run first and not measured (default: 10)")
    parser.add_argument("--log_every", type=int, default=5, help="steps per timing window (default: 5)")
    parser.add_argument("--targets", choices=sorted(TARGETS), help="check the targets set for this hardware: cpu (gpt_small on a 2-core CPU), "
                        "h200 (gpt2_bench on one H200); they mean nothing for other configs")
    parser.error = lambda message: (_ for _ in ()).throw(UsageError(f"{message} (see --help)"))
    args, extra = parser.parse_known_args(argv)
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    args.runners = [r.strip() for r in args.runners.split(",") if r.strip()]
    for p in args.precisions:
        if p not in PRECISIONS:
            raise UsageError(f"--precisions: {p!r} is not one of {', '.join(PRECISIONS)}")
    for r in args.runners:
        if r not in RUNNERS:
            raise UsageError(f"--runners: {r!r} is not one of {', '.join(RUNNERS)}")
    if args.steps < 1 or args.warmup < 0 or args.log_every < 1:
        raise UsageError("--steps and --log_every must be positive and --warmup not negative")
    if args.steps % args.log_every or args.warmup % args.log_every:
        raise UsageError(f"--steps {args.steps} and --warmup {args.warmup} must be multiples of --log_every "
                         f"{args.log_every}: the timing windows must not straddle the warm-up")
    if not Path(args.config).is_file():
        raise UsageError(f"--config '{args.config}' not found: recipe configs are in recipes/configs/")
    if args.output_dir is None:
        args.output_dir = f"runs/benchmark-{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    return args, extra


def run(runner: str, precision: str, args, extra: list[str], root: Path) -> dict:
    """One run in its own process; its metrics and summary, reduced to the benchmark's numbers."""
    out = root / "runs" / f"{runner}-{LABEL[precision]}"
    cmd = [sys.executable, RUNNERS[runner], "--config", args.config, "--mixed_precision", precision,
           "--max_steps", str(args.warmup + args.steps), "--log_every", str(args.log_every),
           "--output_dir", str(out), *extra]
    if runner == "recipe":  # nothing but the loop: no tracker, one checkpoint (at the end, outside the timing)
        cmd += ["--overwrite_output_dir", "--checkpoints_total_limit", "1", "--report_to", "none"]
    out.mkdir(parents=True, exist_ok=True)
    shown = " ".join(["python", *map(shlex.quote, cmd[1:])])
    print(f"[{runner} {LABEL[precision]}] {shown}", flush=True)
    with open(out / "run.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        lines = (out / "run.log").read_text().strip().splitlines()
        error = next((line for line in reversed(lines) if line.startswith("error: ")), None)
        if proc.returncode == 2 and error:
            raise UsageError(f"{runner} {LABEL[precision]}: {error[len('error: '):]}")
        raise SystemExit(f"error: {runner} {LABEL[precision]} exited {proc.returncode}; see {out / 'run.log'}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [r for r in records if "step_time_s" in r and "loss" in r and r["step"] > args.warmup]
    summary = json.loads((out / "summary.json").read_text())
    facts = summary  # the hand-written loop's summary holds samples_per_step and the FLOP facts
    if runner == "recipe":
        import yaml
        facts = {**yaml.safe_load((out / "config.yaml").read_text())["derived"], **summary}
    step_time = statistics.median(r["step_time_s"] for r in windows)
    samples_per_step = facts["samples_per_step"]
    result = {"precision": precision, "runner": runner, "steps_measured": args.steps,
              "step_time_median_s": step_time, "samples_per_s": samples_per_step / step_time,
              "peak_memory_bytes": summary["peak_memory_bytes"], "final_loss": windows[-1]["loss"],
              "flops_per_sample": facts.get("flops_per_sample"), "command": shown}
    if facts.get("tokens_per_sample", 1) > 1:
        result["tokens_per_s"] = result["samples_per_s"] * facts["tokens_per_sample"]
    if "peak_memory_reserved_bytes" in summary:
        result["peak_memory_reserved_bytes"] = summary["peak_memory_reserved_bytes"]
    return result


def peak_flops(precision: str, tf32: bool) -> dict:
    import torch

    from mixprec import hardware, metrics
    device = torch.device(hardware.device_type())
    if device.type == "cpu":
        hardware.set_cpu_threads(None)
    return metrics.peak_flops(device, "bf16" if precision == "fp8" else precision, tf32=tf32)


def table(results: list[dict]) -> str:
    text = any("tokens_per_s" in r for r in results)
    lines = [f"| precision | runner | step time (median) | {'tokens/s' if text else 'samples/s'} | MFU "
             f"| peak memory | final loss |", "|---|---|---|---|---|---|---|"]
    for r in results:
        memory = f"{r['peak_memory_bytes'] / 2**30:.2f} GiB"
        if "peak_memory_reserved_bytes" in r:
            memory += f" ({r['peak_memory_reserved_bytes'] / 2**30:.2f} reserved)"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
        lines.append(f"| {LABEL[r['precision']]} | {r['runner']} | {r['step_time_median_s'] * 1e3:,.1f} ms "
                     f"| {_throughput(r):,.0f} | {mfu} | {memory} | {r['final_loss']:.4f} |")
    return "\n".join(lines)


def ratios(results: list[dict]) -> dict:
    out = {}
    for p in {r["precision"] for r in results}:
        value = _ratio(results, p, "recipe", p, "handwritten")
        if value is not None:
            out[f"recipe/handwritten throughput, {LABEL[p]}"] = value
        for runner in RUNNERS:
            if p != "no" and _find(results, p, runner) and _find(results, "no", runner):
                out[f"{LABEL[p]}/fp32 throughput, {runner}"] = _ratio(results, p, runner, "no", runner)
                out[f"{LABEL[p]}/fp32 peak memory, {runner}"] = _ratio(results, p, runner, "no", runner,
                                                                         "peak_memory_bytes")
    return dict(sorted(out.items()))


def check_targets(name: str | None, results: list[dict]) -> list[dict]:
    checks = []
    for text, fn, bound in TARGETS.get(name, []):
        value = fn(results)
        passed = None if value is None else (value <= -bound if bound < 0 else value >= bound)
        checks.append({"target": text, "value": value, "bound": abs(bound), "passed": passed})
    return checks


def chart(results: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    precisions = [p for p in PRECISIONS if any(r["precision"] == p for r in results)]
    runners = [r for r in RUNNERS if any(x["runner"] == r for x in results)]
    fig = Figure(figsize=(10, 4))
    axes = fig.subplots(1, 2)
    width = 0.8 / len(runners)
    for i, runner in enumerate(runners):
        xs = [j + i * width for j in range(len(precisions))]
        rows = [_find(results, p, runner) for p in precisions]
        axes[0].bar(xs, [_throughput(r) if r else 0 for r in rows], width, label=runner)
        axes[1].bar(xs, [r["peak_memory_bytes"] / 2**30 if r else 0 for r in rows], width, label=runner)
    unit = "tokens/s" if any("tokens_per_s" in r for r in results) else "samples/s"
    for ax, ylabel in zip(axes, (f"throughput ({unit}, median step)", "peak memory (GiB)")):
        ax.set_xticks([j + width * (len(runners) - 1) / 2 for j in range(len(precisions))],
                      [LABEL[p] for p in precisions])
        ax.set_ylabel(ylabel)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


@exit_on_usage_error
def main(argv: list[str] | None = None) -> dict:
    args, extra = parse(sys.argv[1:] if argv is None else argv)
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    started, results = time.time(), []
    for precision in args.precisions:
        peak = peak_flops(precision, tf32="--tf32" in extra)
        for runner in args.runners:
            result = run(runner, precision, args, extra, root)
            result["peak_flops"], result["peak_flops_source"] = peak["peak_flops"], peak["peak_flops_source"]
            if peak["peak_flops"] and result["flops_per_sample"]:
                result["mfu"] = result["samples_per_s"] * result["flops_per_sample"] / peak["peak_flops"]
            results.append(result)
            print(f"  {LABEL[precision]} {runner}: {result['step_time_median_s'] * 1e3:.1f} ms/step, "
                  f"{_throughput(result):,.0f} {'tokens' if 'tokens_per_s' in result else 'samples'}/s", flush=True)
    from mixprec.hardware import machine_line
    hardware = machine_line()
    report = {"config": args.config, "extra_flags": extra, "steps": args.steps, "warmup": args.warmup,
              "hardware": hardware, "wall_time_s": time.time() - started, "results": results,
              "ratios": ratios(results), "targets": check_targets(args.targets, results)}
    (root / "benchmark.json").write_text(json.dumps(report, indent=2) + "\n")
    title = f"{Path(args.config).stem}, {args.steps} steps after {args.warmup} warm-up; {hardware}"
    lines = [f"**{title}**", "", table(results), ""]
    lines += [f"- {k}: {v:.2f}x" for k, v in report["ratios"].items()]
    for t in report["targets"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["passed"]]
        value = "n/a" if t["value"] is None else f"{t['value']:.3g}"
        lines.append(f"- target: {t['target']}: {value} (bound {t['bound']:g}): **{verdict}**")
    lines += ["", "Command:", "", f"    python recipes/benchmark.py {' '.join(map(shlex.quote, argv or sys.argv[1:]))}"]
    (root / "benchmark.md").write_text("\n".join(lines) + "\n")
    chart(results, root / "benchmark.png", title)
    print("\n" + "\n".join(lines) + f"\n\nwrote {root}/benchmark.json, benchmark.md, benchmark.png")
    return report


if __name__ == "__main__":
    main()
