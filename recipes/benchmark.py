#!/usr/bin/env python
"""Precisions side by side, and the recipe against a hand-written loop and the floor, for one model and config.

    python recipes/benchmark.py --config recipes/configs/gpt_small.yaml --precisions no,bf16 --targets cpu
    python recipes/benchmark.py --config recipes/configs/gpt_small.yaml --variants plain,compile   # --compile too
    python recipes/benchmark.py --config recipes/configs/gpt_small.yaml --runners recipe,floor,hf_trainer
    python recipes/benchmark.py --config recipes/configs/hf_gpt2_small.yaml --runners recipe,hf_accelerate,hf_trainer \
        --targets cpu_hf      # the peers (after: python scripts/make_tiny_hf.py runs/hf_gpt2_small --arch gpt2_small)
    python recipes/benchmark.py --render DIR   # DIR/benchmark.md again from DIR/benchmark.json; nothing runs

Runners, each run in its own process with the same seed, number of steps and flags:
- recipe: recipes/train.py (Accelerate, health checks, the run folder; no tracker, no text sample);
- recipe_checks_off (not run by default): the recipe with --no-health_checks --no-lost_updates, as its own row in
  the same rounds, so that what the checks cost shows round by round beside the peers;
- handwritten: benchmarks/baselines/handwritten_loop.py (the lesson's loop in plain PyTorch over the package's batches);
- floor: benchmarks/baselines/floor_loop.py (nanoGPT-style: tensors in memory, a random index per step, nothing else);
- accelerate: benchmarks/baselines/accelerate_loop.py (the minimal Accelerate loop: Accelerator(mixed_precision=...),
  prepare, accumulate, autocast, backward, clip, step over the package's batches; what the recipe costs beyond it
  is the recipe's own work);
- hf_accelerate (a peer, not run by default): benchmarks/peers/hf_accelerate.py, a plain Accelerate loop in
  the style of transformers' run_clm_no_trainer.py;
- hf_trainer (a peer, not run by default): benchmarks/peers/hf_trainer.py, transformers' Trainer.
  Both peers train the config's transformers model (--config_name / --model_name_or_path: the recipe's own
  model, weights and token blocks) or, for a built-in GPT config, a GPT2LMHeadModel of its size.
Variants: plain, compile (the same run with --compile; compilation falls in the warm-up steps).
Every precision x runner x variant runs --repeats times (default 3), interleaved: all of them once, then all
of them again, so that a slow spell of the machine spreads over all; each round in an order rotated by one
(round k starts with the k-th row: `round_order`), so that no row always runs first. Each run logs the mean step time of each
window of --log_every steps; the windows after --warmup steps give the run's median step time. A row of the
table is the median of its runs, with their spread ((slowest - fastest) / median), samples/s (tokens/s for
text) and MFU (one peak FLOP/s per precision: --peak_flops if given, the datasheet table on known GPUs, else
a matmul probed here for fp32 or a native bf16/fp16 CPU, before the runs and again after each round, the best
probe counting; none where bf16/fp16 is emulated: MFU n/a). Targets and the paired ratios compare runs of one
round: per round, one row's step time over the other's, then the median over the rounds (mixprec.
benchmark_rounds.paired). The runs of a round are minutes apart and share the machine's slow drifts; rows' medians do not cancel
them, and "the faster of two peers" taken from noisy medians favours the peers even where all run alike.
benchmark.md shows every round. Peak memory: CUDA max
allocated and reserved, or the CPU process's peak resident set (the largest of the runs). Flags the benchmark
does not know (--tf32, --batch_size, --cpu_threads, ...) go to every runner.

Writes DIR/benchmark.json (`machine`: the hardware, CPU flags, threads, load average before and after, the
share of the CPUs other processes used; `runs`: every run; `results`: the rows; `ratios`, `targets`) and
DIR/benchmark.md after every run, so that a stopped benchmark keeps what it measured, and DIR/benchmark.png at
the end; each run's own folder and log are under DIR/runs/. DIR is a new folder under runs/ unless
--output_dir says otherwise; a folder that holds a benchmark already is refused without --overwrite_output_dir.
Run it on an otherwise idle machine: timings take whatever else runs as their own (the report says when the
machine looked busy).
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mixprec import benchmarking as bm
from mixprec.errors import UsageError, exit_on_usage_error

REPO = Path(__file__).resolve().parents[1]

RUNNERS = {"recipe": "recipes/train.py", "recipe_checks_off": "recipes/train.py",
           "handwritten": "benchmarks/baselines/handwritten_loop.py",
           "floor": "benchmarks/baselines/floor_loop.py", "accelerate": "benchmarks/baselines/accelerate_loop.py",
           "hf_accelerate": "benchmarks/peers/hf_accelerate.py",
           "hf_trainer": "benchmarks/peers/hf_trainer.py"}
LABEL = bm.LABEL
CHECKS_OFF = ["--no-health_checks", "--no-lost_updates"]  # the recipe_checks_off runner's flags
RECIPE_ROWS = ("recipe", "recipe_checks_off")  # recipes/train.py's rows: its flags, its config.yaml
RECIPE_EXTRA = ["--overwrite_output_dir", "--checkpoints_total_limit", "1", "--report_to", "none", "--sample_tokens",
                "0"]  # the recipe's rows: nothing but the loop (no tracker, no text sample, one checkpoint at the end)


def _pair(p1: str, r1: str, p2: str, r2: str, key: str | None = None):
    """check(results, runs): throughput of precision p1 through runner r1 over p2 through r2, the median of the
    rounds' paired ratios (bm.paired); with `key` (peak memory), the rows' medians."""
    if key:
        return lambda results, runs: bm.ratio(results, (p1, r1), (p2, r2), key)
    return lambda results, runs: bm.paired_median(runs, (p1, r1), (p2, r2))


def _over_best_peer(p: str):
    """check(results, runs): the recipe's throughput over the faster of the two peers present, in precision p:
    against each peer the median of the rounds' paired ratios, then the smaller of the two."""
    def check(results, runs):
        peers = [v for r in ("hf_accelerate", "hf_trainer") if (v := bm.paired_median(runs, (p, "recipe"), (p, r)))]
        return min(peers) if peers else None
    return check


def _own_ms(p: str):
    """check(results, runs): the recipe's step time minus the minimal Accelerate loop's in the same round, in ms,
    the median over the rounds, precision p."""
    def check(results, runs):
        own = bm.paired_difference(runs, (p, "recipe"), (p, "accelerate"))
        return None if own is None else own * 1e3
    return check


def _mfu(results, runs):
    return (bm._find(results, "bf16", "recipe") or {}).get("mfu")


# (description, check(results, runs) -> value or None when the runs needed are missing, bound; negative: at most)
TARGETS = {
    "cpu": [("recipe within 5% of the hand-written loop, fp32", _pair("no", "recipe", "no", "handwritten"), 0.95),
            ("recipe within 5% of the hand-written loop, bf16", _pair("bf16", "recipe", "bf16", "handwritten"), 0.95),
            ("bf16 at least 1.5x fp32 throughput (recipe)", _pair("bf16", "recipe", "no", "recipe"), 1.5)],
    "cpu_mlp": [("recipe at most 0.3 ms/step beyond the minimal Accelerate loop, fp32", _own_ms("no"), -0.3),
                ("recipe at most 0.3 ms/step beyond the minimal Accelerate loop, bf16", _own_ms("bf16"), -0.3)],
    "cpu_hf": [("recipe at least 0.97x the faster peer (Accelerate loop, Trainer), fp32", _over_best_peer("no"), 0.97),
               ("recipe at least 0.97x the faster peer (Accelerate loop, Trainer), bf16", _over_best_peer("bf16"),
                0.97)],
    "h200": [("bf16 MFU at least 45% (recipe)", _mfu, 0.45),
             ("bf16 at least 1.8x fp32+TF32 throughput (recipe)", _pair("bf16", "recipe", "no", "recipe"), 1.8),
             ("bf16 peak memory at most 0.65x fp32 (recipe)",
              _pair("bf16", "recipe", "no", "recipe", "peak_memory_bytes"), -0.65),
             ("fp16 + GradScaler within 5% of bf16 (recipe)", _pair("fp16", "recipe", "bf16", "recipe"), 0.95),
             ("recipe at least 98% of the hand-written loop, bf16", _pair("bf16", "recipe", "bf16", "handwritten"),
              0.98)],
}


def _list(text: str, flag: str, allowed) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    for x in items:
        if x not in allowed:
            raise UsageError(f"{flag}: {x!r} is not one of {', '.join(allowed)}")
    if not items:
        raise UsageError(f"{flag} is empty: give one or more of {', '.join(allowed)}")
    return list(dict.fromkeys(items))


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="recipe config, e.g. recipes/configs/gpt_small.yaml")
    parser.add_argument("--precisions", default="no,bf16", help="comma-separated: no (fp32), fp16, bf16, fp8")
    parser.add_argument("--runners", default="recipe,handwritten,floor",
                        help="comma-separated: recipe, recipe_checks_off, handwritten, floor, accelerate, "
                        "hf_accelerate, hf_trainer (default: recipe,handwritten,floor)")
    parser.add_argument("--variants", default="plain", help="comma-separated: plain, compile (default: plain)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each row, interleaved (default: 3)")
    parser.add_argument("--output_dir", default=None, help="default: runs/benchmark-<config>-<date>-<time>")
    parser.add_argument("--overwrite_output_dir", action="store_true",
                        help="replace a benchmark in --output_dir")
    parser.add_argument("--steps", type=int, default=30, help="measured optimizer steps per run (default: 30)")
    parser.add_argument("--warmup", type=int, default=10, help="steps run first and not measured (default: 10)")
    parser.add_argument("--log_every", type=int, default=5, help="steps per timing window (default: 5)")
    parser.add_argument("--targets", choices=sorted(TARGETS), help="check the targets set for this hardware: "
                        "cpu (gpt_small on a 2-core CPU), cpu_hf (hf_gpt2_small against its peers), h200 (gpt2_bench on one H200); they mean nothing for "
                        "other configs")
    parser.error = lambda message: (_ for _ in ()).throw(UsageError(f"{message} (see --help)"))
    args, extra = parser.parse_known_args(argv)
    args.precisions = _list(args.precisions, "--precisions", bm.PRECISIONS)
    args.runners = _list(args.runners, "--runners", list(RUNNERS))
    args.variants = _list(args.variants, "--variants", bm.VARIANTS)
    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats} must be at least 1 (3 or more for a spread worth reading)")
    if args.steps < 1 or args.warmup < 0 or args.log_every < 1:
        raise UsageError("--steps and --log_every must be positive and --warmup not negative")
    if args.steps % args.log_every or args.warmup % args.log_every:
        raise UsageError(f"--steps {args.steps} and --warmup {args.warmup} must be multiples of --log_every "
                         f"{args.log_every}: the timing windows must not straddle the warm-up")
    if "--compile" in extra:
        raise UsageError("--compile: use --variants compile (or plain,compile for both in one table)")
    peak = argparse.ArgumentParser(add_help=False)  # runners' flags the benchmark's own MFU needs too
    peak.add_argument("--peak_flops", type=float)
    peak.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=False)
    peak.error = parser.error
    known, _ = peak.parse_known_args(extra)
    if known.peak_flops is not None and not (known.peak_flops > 0 and math.isfinite(known.peak_flops)):
        raise UsageError(f"--peak_flops {known.peak_flops:g} must be positive and finite: the device's peak "
                         f"FLOP/s, e.g. 1e12")
    args.peak_flops, args.tf32 = known.peak_flops, known.tf32
    if not Path(args.config).is_file():
        raise UsageError(f"--config '{args.config}' not found: recipe configs are in recipes/configs/")
    if args.output_dir is None:
        args.output_dir = f"runs/benchmark-{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if (Path(args.output_dir) / "benchmark.json").exists() and not args.overwrite_output_dir:
        raise UsageError(f"--output_dir {args.output_dir} holds a benchmark already: give a new folder "
                         f"(or --overwrite_output_dir)")
    return args, extra


def command(runner: str, precision: str, variant: str, args, extra: list[str], out: Path) -> list[str]:
    cmd = [sys.executable, RUNNERS[runner], "--config", args.config, "--mixed_precision", precision,
           "--max_steps", str(args.warmup + args.steps), "--log_every", str(args.log_every),
           "--output_dir", str(out), *extra, *(["--compile"] if variant == "compile" else [])]
    if runner in RECIPE_ROWS:
        cmd += RECIPE_EXTRA
    if runner == "recipe_checks_off":  # the measurements the recipe makes while it trains, off
        cmd += CHECKS_OFF
    return cmd


def round_order(plan: list, repeat: int) -> list:
    """The rows of round `repeat` (1-based): the plan rotated by repeat - 1, so that over len(plan) rounds each
    row runs once in each position."""
    k = (repeat - 1) % len(plan)
    return plan[k:] + plan[:k]


def run(runner: str, precision: str, variant: str, repeat: int, args, extra: list[str], root: Path) -> dict:
    """One run in its own process; its metrics and summary, reduced to the benchmark's numbers."""
    name = f"{runner}-{LABEL[precision]}{'-compiled' if variant == 'compile' else ''}-{repeat}"
    out = root / "runs" / name
    cmd = command(runner, precision, variant, args, extra, out)
    out.mkdir(parents=True, exist_ok=True)
    shown = " ".join(["python", *map(shlex.quote, cmd[1:])])
    print(f"[{name}] {shown}", flush=True)
    meter = bm.LoadMeter()
    with open(out / "run.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    load = meter.stop()
    if proc.returncode:
        lines = (out / "run.log").read_text().strip().splitlines()
        error = next((line for line in reversed(lines) if line.startswith("error: ")), None)
        if proc.returncode == 2 and error:
            raise UsageError(f"{runner} {LABEL[precision]}: {error[len('error: '):]}")
        raise SystemExit(f"error: {name} exited {proc.returncode}; see {out / 'run.log'}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [r for r in records if "step_time_s" in r and "loss" in r and r["step"] > args.warmup]
    summary = json.loads((out / "summary.json").read_text())
    facts = summary  # the loops' summaries hold samples_per_step and the FLOP facts
    if runner in RECIPE_ROWS:
        import yaml
        run_info = yaml.safe_load((out / "config.yaml").read_text())
        facts = {**run_info["derived"], **summary,
                 "cpu_threads": (run_info["effective"].get("cpu_threads") or {}).get("threads")}
    result = {"precision": precision, "runner": runner, "variant": variant, "repeat": repeat,
              "step_time_median_s": statistics.median(r["step_time_s"] for r in windows),
              "samples_per_step": facts["samples_per_step"], "tokens_per_sample": facts.get("tokens_per_sample", 1),
              "flops_per_sample": facts.get("flops_per_sample"), "peak_memory_bytes": summary["peak_memory_bytes"],
              "final_loss": windows[-1]["loss"], "cpu_threads": facts.get("cpu_threads"), "command": shown, **load}
    if "peak_memory_reserved_bytes" in summary:
        result["peak_memory_reserved_bytes"] = summary["peak_memory_reserved_bytes"]
    return result


def peak_flops(precision: str, args) -> dict:
    """The peak FLOP/s behind a precision's MFU: --peak_flops among the runners' flags, the datasheet table, or a
    matmul measured here (probed again after each round: the best probe counts, bm.add_probe)."""
    import torch

    from mixprec.devices import hardware
    from mixprec import metrics
    device = torch.device(hardware.device_type())
    if device.type == "cpu":
        hardware.set_cpu_threads(None)
    return metrics.peak_flops(device, "bf16" if precision == "fp8" else precision, tf32=args.tf32,
                              override=args.peak_flops)


def probe_again(peaks: dict, args) -> dict:
    return {p: bm.add_probe(peak, peak_flops(p, args)["peak_flops"]) if bm.probed(peak) else peak
            for p, peak in peaks.items()}


def check_targets(name: str | None, results: list[dict], runs: list[dict]) -> list[dict]:
    checks = []
    for text, fn, bound in TARGETS.get(name, []):
        value = fn(results, runs)
        passed = None if value is None else (value <= -bound if bound < 0 else value >= bound)
        checks.append({"target": text, "value": value, "bound": abs(bound), "passed": passed})
    return checks


def write(report: dict, root: Path, shown: str, peaks: dict, rendered: bool = False) -> None:
    """benchmark.json and benchmark.md from the runs so far (written after every run; `rendered`: again, later)."""
    report["results"] = bm.aggregate(report["runs"], peaks)
    report["ratios"] = bm.ratios(report["results"], report["runs"])
    report["targets"] = check_targets(report["targets_name"], report["results"], report["runs"])
    report["command"] = shown
    if not rendered:
        report["wall_time_s"] = time.time() - report["started"]
    tmp = root / "benchmark.json.tmp"
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(root / "benchmark.json")
    (root / "benchmark.md").write_text(bm.markdown(report, shown))


def render(argv: list[str]) -> dict:
    """`--render DIR`: DIR/benchmark.json's report and benchmark.md again, from its runs (after a change to how
    the report reads them); nothing runs, the runs' numbers stay as measured."""
    if len(argv) != 1 or not (Path(argv[0]) / "benchmark.json").is_file():
        raise UsageError(f"--render {' '.join(argv) or '(nothing)'}: give one folder that holds a benchmark.json")
    root = Path(argv[0])
    report = json.loads((root / "benchmark.json").read_text())
    old = (root / "benchmark.md").read_text() if (root / "benchmark.md").is_file() else ""
    shown = report.get("command") or (old.rpartition("Command:\n\n    ")[2].strip() if "Command:" in old else "")
    runs = report.get("runs") or []
    if "peaks" not in report or not shown or not all({"repeat", "variant"} <= set(r) for r in runs):
        raise UsageError(f"--render {root}: its benchmark.json was written before rounds and peaks were recorded "
                         f"(or its benchmark.md names no command): it cannot be written again")
    write(report, root, shown, report["peaks"], rendered=True)
    print((root / "benchmark.md").read_text() + f"\nwrote {root}/benchmark.json, benchmark.md again")
    return report


@exit_on_usage_error
def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--render"]:
        return render(argv[1:])
    args, extra = parse(argv)
    root = Path(args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    peaks = {p: peak_flops(p, args) for p in args.precisions}
    plan = [(v, p, r) for v in args.variants for p in args.precisions for r in args.runners]
    from mixprec.devices.hardware import machine_line
    report = {"config": args.config, "extra_flags": extra, "steps": args.steps, "warmup": args.warmup,
              "repeats": args.repeats, "variants": args.variants, "hardware": machine_line(),
              "machine": bm.machine(), "started": time.time(), "complete": False,
              "planned_runs": len(plan) * args.repeats, "targets_name": args.targets, "peaks": peaks,
              "order": "rotated", "runs": []}
    shown = f"python recipes/benchmark.py {' '.join(map(shlex.quote, argv))}"
    for repeat in range(1, args.repeats + 1):  # interleaved: every row once, then every row again
        for variant, precision, runner in round_order(plan, repeat):
            result = run(runner, precision, variant, repeat, args, extra, root)
            report["runs"].append(result)
            report["machine"]["loadavg_after"] = result.get("loadavg_after")
            write(report, root, shown, peaks)
            unit = "tokens" if result["tokens_per_sample"] > 1 else "samples"
            rate = result["samples_per_step"] * result["tokens_per_sample"] / result["step_time_median_s"]
            print(f"  {result['step_time_median_s'] * 1e3:.1f} ms/step, {rate:,.0f} {unit}/s, other processes "
                  f"{result.get('other_cpu_share', 0):.0%} of the CPUs", flush=True)
        peaks = probe_again(peaks, args)
        report["peaks"] = peaks
    report["complete"] = True
    write(report, root, shown, peaks)
    title = (f"{bm.subject(args.config, extra)}, {args.steps} steps after {args.warmup} warm-up, median of {args.repeats}; "
             f"{report['hardware']}")
    bm.chart(report["results"], root / "benchmark.png", title)
    print("\n" + (root / "benchmark.md").read_text() + f"\nwrote {root}/benchmark.json, benchmark.md, benchmark.png")
    return report


if __name__ == "__main__":
    main()
