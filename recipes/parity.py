#!/usr/bin/env python
"""Parity bands: is bf16 (fp16, bf16 weights) costing this model accuracy? Measured against fp32's own seed spread.

    python recipes/parity.py --config recipes/configs/mlp.yaml --precisions fp32,bf16,fp16 --seeds 5
    python recipes/parity.py --precisions fp32,bf16-weights-round,bf16-weights-stochastic --max_steps 300 --lr 1e-4
    python recipes/parity.py --precisions fp32,bf16 --seeds 9,10 --max_steps 200 --eval_steps 50 \\
        --band tests/data/parity_band_mlp.json      # against the committed band, as CI

Each precision runs the configuration once per seed (`python recipes/train.py`, one run after another), each an
ordinary run folder, OUTPUT_DIR/<precision>-seed<S>/ (config.yaml, metrics.jsonl, checkpoints; its console output
in OUTPUT_DIR/<precision>-seed<S>.log). Running the same command again reuses the finished runs and resumes the
others with --resume_from_checkpoint latest (a checkpoint at every evaluation unless --checkpointing_steps says
otherwise). Precisions: fp32, bf16, fp16 (autocast; fp16 with the GradScaler), bf16-weights-round,
bf16-weights-kahan, bf16-weights-stochastic (--mixed_precision bf16 --master_weights bf16 --bf16_update MODE).
Every other flag goes to recipes/train.py as it is (--lr 1e-4, --model_args ...), the same for every run.

The fp32 band is built per evaluation point (--eval_steps; default a sixth of --max_steps) from the fp32 seeds'
validation losses, or read from --band (a parity.json of the same settings): see mixprec/parity.py for the
calibration. Writes OUTPUT_DIR/parity.json (the band, every curve, the verdicts, the intervals), parity.md (the
table) and parity.png, and prints the table. A precision whose run skipped every optimizer step in a seed (fp16's
GradScaler when every step overflows) is reported not trained, and not inside. Exit code 0: every precision stays
inside the band; 1: one leaves it or did not train (the line names it, the step and by how much); 2: bad input
(one line, nothing written); 4: a run failed (its log named); 75: stopped by a signal after the running run saved a
checkpoint (run the same command again).
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from mixprec import parity
from mixprec.errors import UsageError, exit_on_usage_error

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "recipes" / "train.py"
VARIANTS = {"fp32": ["--mixed_precision", "no"], "bf16": ["--mixed_precision", "bf16"],
            "fp16": ["--mixed_precision", "fp16"],
            **{f"bf16-weights-{mode}": ["--mixed_precision", "bf16", "--master_weights", "bf16", "--bf16_update", mode]
               for mode in ("round", "kahan", "stochastic")}}
# flags this command sets for each run; the precision's flags come from its name
OWNED = {"--mixed_precision": "--precisions", "--master_weights": "--precisions (bf16-weights-MODE)",
         "--bf16_update": "--precisions (bf16-weights-MODE)", "--seed": "--seeds",
         "--output_dir": "parity's --output_dir", "--resume_from_checkpoint": "running the same command again",
         "--overwrite_output_dir": "another --output_dir", "--no-overwrite_output_dir": "another --output_dir"}
SETTINGS = "parity-settings.json"
FINAL_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def parse_seeds(text: str) -> list[int]:
    """--seeds: N (seeds 1..N), A-B (A..B) or a comma list (3,7,11)."""
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",")]
        elif "-" in text.strip("-"):
            a, b = (int(s) for s in text.split("-"))
            seeds = list(range(a, b + 1))
        else:
            seeds = list(range(1, int(text) + 1))
    except ValueError:
        raise UsageError(f"--seeds {text!r}: give a count (5), a range (6-10) or a list (1,4,9)") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds {text!r}: give at least one seed, none negative or repeated")
    return seeds


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)  # --seed is the recipe's, not --seeds
    parser.add_argument("--config", default="recipes/configs/mlp.yaml", help="the recipe config (recipes/configs/)")
    parser.add_argument("--precisions", default="fp32,bf16,fp16", help=f"comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--seeds", default="5",
                        help="a count N (seeds 1..N), a range A-B or a list 1,4,9 (one seed: 7-7)")
    parser.add_argument("--max_steps", type=int, help="optimizer steps per run (default: the config's)")
    parser.add_argument("--eval_steps", type=int, help="the band's points (default: a sixth of --max_steps)")
    parser.add_argument("--output_dir", type=Path, help="the study's folder (default: runs/parity-<config name>)")
    parser.add_argument("--band", type=Path, help="check against this parity.json's fp32 band instead of running fp32 "
                                                  "seeds for one (the same settings)")
    parser.add_argument("--alpha", type=float, help="the band's false-alarm rate per precision (default 0.01)")
    parser.add_argument("--floor", type=float, help="the band's least half-width, relative to fp32's mean "
                                                    "(default 0.001)")
    args, passthrough = parser.parse_known_args(argv)
    for flag in passthrough:
        name = flag.split("=", 1)[0]
        if name in OWNED:
            raise UsageError(f"{name} is set by parity for each run: use {OWNED[name]}")
    names = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in names if p not in VARIANTS]
    if unknown or not names or len(set(names)) != len(names):
        raise UsageError(f"--precisions {args.precisions!r}: name each once, from {', '.join(VARIANTS)}")
    args.precisions, args.seeds = names, parse_seeds(args.seeds)
    for name in ("max_steps", "eval_steps"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise UsageError(f"--{name} {getattr(args, name)} must be positive: give a value above 0")
    if args.alpha is not None and not 0 < args.alpha < 1:
        raise UsageError(f"--alpha {args.alpha}: give a rate between 0 and 1, e.g. 0.01")
    if args.floor is not None and not 0 <= args.floor < 1:
        raise UsageError(f"--floor {args.floor}: give a share between 0 and 1, e.g. 0.001")
    return args, passthrough


def plan(args: argparse.Namespace, passthrough: list[str]) -> tuple[list[str], dict]:
    """The flags every run shares and the settings a rerun and a --band must agree with; every variant's flags
    parsed as recipes/train.py parses them, so that bad input stops here, before anything is written."""
    from mixprec import config

    common = ["--config", args.config]
    if args.max_steps:
        common += ["--max_steps", str(args.max_steps)]
    cfg = config.parse_config([*common, *passthrough])
    eval_steps = args.eval_steps or cfg.eval_steps or (max(1, cfg.max_steps // 6) if cfg.max_steps else None)
    if eval_steps != cfg.eval_steps:  # parity's --eval_steps over the config's
        common += ["--eval_steps", str(eval_steps)]
    if eval_steps and not cfg.checkpointing_steps:  # a killed run resumes from its last evaluation
        common += ["--checkpointing_steps", str(eval_steps)]
    common += passthrough
    from mixprec import precision
    from mixprec.precision import master_weights

    for name in args.precisions:  # and the precision's own checks (bf16 weights with --fp32_modules, ...)
        cfg = config.parse_config([*common, *VARIANTS[name], "--seed", str(args.seeds[0])])
        master_weights.check(cfg, precision.choose(cfg))
    settings = {"config": config.load_yaml(args.config), "flags": common[2:]}
    return common, settings


def load_band(args: argparse.Namespace, settings: dict) -> parity.Band | None:
    if args.band is None:
        if "fp32" not in args.precisions or len(args.seeds) < 3:
            raise UsageError("the fp32 band needs fp32 among --precisions and at least 3 --seeds (5 or more give "
                             "a narrower band), or a committed band: --band parity.json")
        return None
    try:
        data = json.loads(args.band.read_text())
        band = parity.Band.from_dict(data["band"])
        theirs = data["settings"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"--band '{args.band}' is not a readable parity.json ({type(err).__name__}): give the "
                         f"parity.json of an earlier run of this command") from None
    if theirs != settings:
        raise UsageError(f"--band '{args.band}' was calibrated with other settings (flags {' '.join(theirs['flags'])}"
                         f"; here {' '.join(settings['flags'])}, or another config's content): use its settings or "
                         f"calibrate a band for these")
    return band


def open_study(out: Path, settings: dict) -> None:
    """The study's folder, holding the settings its runs share: a rerun with other settings is refused."""
    record = out / SETTINGS
    if record.is_file():
        if json.loads(record.read_text()) != settings:
            raise UsageError(f"--output_dir '{out}' holds a parity study with other settings (see {record}): give "
                             f"another --output_dir, or this study's flags to continue it")
        return
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--output_dir '{out}' holds other files: give a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(settings, indent=1) + "\n")


class Runner:
    """One recipe run at a time; a signal to this process goes to the run, which checkpoints and exits 75."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        for sig in FINAL_SIGNALS:
            signal.signal(sig, self._forward)

    def _forward(self, signum, frame) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)  # the run checkpoints and exits 75, and so does this command
            return
        print("error: stopped by a signal between runs: run the same command again to continue", file=sys.stderr)
        sys.exit(75)

    def run(self, cmd: list[str], log: Path) -> int:
        with open(log, "a") as f:
            f.write(f"$ {shlex.join(cmd)}\n")
            f.flush()
            self.child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            while True:
                try:
                    return self.child.wait()
                except InterruptedError:
                    continue


def read_curve(run_dir: Path) -> dict[int, float]:
    """{step: val_loss} from metrics.jsonl (the last record of a step, as a resume may log a step again)."""
    curve = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        record = json.loads(line)
        if "val_loss" in record:
            value = record["val_loss"]
            curve[int(record["step"])] = float(value) if isinstance(value, (int, float)) else math.nan
    return curve


def read_skipped(run_dir: Path) -> tuple[int, int] | None:
    """(skipped optimizer steps, optimizer steps) from the run's summary.json, or None without one."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        return int(summary["skipped_steps"]), int(summary["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def train_one(runner: Runner, out: Path, common: list[str], name: str, seed: int) -> tuple[dict, str]:
    """Run (or reuse, or resume) one seed of one precision; its curve and how it ended."""
    run_dir = out / f"{name}-seed{seed}"
    if (run_dir / "summary.json").is_file():
        return read_curve(run_dir), "reused"
    cmd = [sys.executable, str(TRAIN), *common, *VARIANTS[name], "--seed", str(seed), "--output_dir", str(run_dir)]
    if (run_dir / "checkpoints" / "latest").is_file():
        cmd += ["--resume_from_checkpoint", "latest"]
    elif run_dir.exists():  # killed before its first checkpoint: this study's own folder, started again
        cmd += ["--overwrite_output_dir"]
    log = out / f"{name}-seed{seed}.log"
    start = time.monotonic()
    code = runner.run(cmd, log)
    if code == 75:
        print(f"error: stopped by a signal during {name} seed {seed} (checkpoint saved): run the same command "
              f"again to continue", file=sys.stderr)
        sys.exit(75)
    if code == 2:
        lines = [x for x in log.read_text().splitlines() if x.startswith("error:")]
        raise UsageError(f"{name} seed {seed}: " + (lines[-1].removeprefix("error: ") if lines else f"see {log}"))
    if code not in (0, 3):
        print(f"error: the run {run_dir} ended with exit code {code}: its output is in {log}", file=sys.stderr)
        sys.exit(4)
    how = "done" if code == 0 else "halted on a non-finite loss (exit 3)"
    return read_curve(run_dir), f"{how} in {time.monotonic() - start:.0f} s"


def evaluate(args, settings: dict, band: parity.Band | None, curves: dict, skipped: dict | None = None) -> dict:
    """The verdicts and the result as parity.json holds it."""
    from mixprec.devices.hardware import machine_line

    reference = None
    if band is None:
        band = parity.band_from_curves(curves["fp32"], 0.01 if args.alpha is None else args.alpha,
                                       0.001 if args.floor is None else args.floor)
        reference = "fp32"
    else:
        band.alpha = band.alpha if args.alpha is None else args.alpha
        band.floor = band.floor if args.floor is None else args.floor
    verdicts = [parity.verdict(name, curves[name], band, (skipped or {}).get(name)) for name in args.precisions]
    command = "python recipes/parity.py " + shlex.join(args.argv)
    return {"title": f"parity: {Path(args.config).name}, {' '.join(settings['flags'])}",
            "command": command, "machine": machine_line(), "cpu_kind": parity.cpu_kind(), "settings": settings,
            "reference": reference, "band_file": str(args.band) if args.band else None,
            "band": band.to_dict(len(args.seeds)),
            "precisions": {v.name: {**v.to_dict(), "curves": {str(s): curves[v.name][s] for s in v.seeds}}
                           for v in verdicts},
            "exit_code": int(any(not v.inside for v in verdicts if v.name != reference))}, verdicts


def write_report(out: Path, result: dict, verdicts: list) -> list[str]:
    from mixprec.tracking.band_plot import plot_bands

    band = result["band"]
    head = [f"{result['machine']} ({result['cpu_kind']}); `{result['command']}`", "",
            f"The fp32 band at {len(band['steps'])} evaluation points (steps {band['steps'][0]} to "
            f"{band['steps'][-1]}): fp32's mean over {band['n']} seeds +/- t * s * sqrt(1/{band['n']} + "
            f"1/{band['checked_seeds']}), t = {band['q']:.2f} (alpha {band['alpha']:g} over the points, "
            f"Bonferroni), at least {band['floor']:.1%} of the mean" +
            (f"; read from {result['band_file']}." if result["band_file"] else "."), ""]
    lines = head + parity.table(verdicts, result["reference"])
    (out / "parity.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "parity.md").write_text("\n".join(lines) + "\n")
    plot_bands(result, out / "parity.png")
    return lines


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, passthrough = parse_args(argv)
    args.argv = argv
    common, settings = plan(args, passthrough)
    band = load_band(args, settings)
    out = args.output_dir or Path("runs") / f"parity-{Path(args.config).stem}"
    open_study(out, settings)
    runner, curves, skipped = Runner(), {}, {}
    for name in args.precisions:
        curves[name], skipped[name] = {}, {}
        for seed in args.seeds:
            curves[name][seed], how = train_one(runner, out, common, name, seed)
            last = curves[name][seed][max(curves[name][seed])] if curves[name][seed] else math.nan
            counts = read_skipped(out / f"{name}-seed{seed}")
            if counts is not None:
                skipped[name][seed] = counts
            skips = f", {counts[0]:,} of {counts[1]:,} optimizer steps skipped" if counts and counts[0] else ""
            print(f"{name} seed {seed}: {how}, final val_loss {last:.4f}{skips}", flush=True)
    result, verdicts = evaluate(args, settings, band, curves, skipped)
    print("\n".join(write_report(out, result, verdicts)))
    for v in verdicts:
        if v.name != result["reference"] and not v.inside:
            print(f"{v.name} leaves the fp32 band: {v.where()}")
    print(f"results: {out}/parity.json, parity.md, parity.png")
    return result["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
