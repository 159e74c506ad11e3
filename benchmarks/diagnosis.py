#!/usr/bin/env python
"""The diagnosis benchmark: does the doctor say nothing when nothing is wrong, the right cause at once when
something is, and a fix that works? Each scenario (benchmarks/diagnosis_scenarios.py) is a real run of
recipes/train.py, each in a fresh process forked from a server that has imported torch and mixprec once
(a fresh interpreter costs about 6 s of start-up each).

    python benchmarks/diagnosis.py                       # every scenario; the table on stdout
    python benchmarks/diagnosis.py --only mlp-fp16,lr-far-too-high --out benchmarks/results/x.md

Healthy scenarios must raise no event (each event is a false alarm). For an unhealthy one: every event must
name the expected cause (and the module, where there is one), the first must come within 5 steps of the
problem's onset, and the first event's fix, applied (flags to the arguments; "data: ..." and "code: ..." by
the scenario: the cleaned file, the fault removed), must give a run with no event.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
import time
import multiprocessing
from pathlib import Path

from diagnosis_scenarios import Scenario, scenarios

REPO = Path(__file__).resolve().parents[1]

MAX_DELAY = 5  # steps from onset to the first event


def _child(name: str, args: list[str], with_fault: bool) -> None:
    """One training run, in a process forked from the fork server (torch and mixprec already imported, nothing
    run): recipes/train.py's main, with the scenario's fault on the built model; its console to console.txt."""
    import contextlib
    import importlib.util

    from mixprec import models

    spec = importlib.util.spec_from_file_location("train", REPO / "recipes" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    fault = next(s.fault for s in scenarios() if s.name == name) if with_fault else None
    build = models.build

    def faulty(*a, **kw):
        model = build(*a, **kw)
        fault(model)
        return model

    if fault is not None:
        models.build = faulty
    out = Path(args[args.index("--output_dir") + 1])
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}-console.txt", "w") as console, contextlib.redirect_stdout(console), \
            contextlib.redirect_stderr(console):
        train.main(args)


def _train(name: str, args: list[str], with_fault: bool) -> tuple[int, list[dict], dict]:
    """A run of the scenario in a fresh process (forked from a server that has imported torch and mixprec, so
    that each run skips the start-up): (exit code, metrics.jsonl records, summary.json)."""
    process = _context().Process(target=_child, args=(name, args, with_fault))
    process.start()
    process.join(600)
    if process.exitcode is None:
        process.kill()
        process.join()
    code = process.exitcode
    out = Path(args[args.index("--output_dir") + 1])
    if code:
        console = out.parent / f"{out.name}-console.txt"
        print(f"  exit {code}: {console.read_text()[-500:] if console.exists() else ''}", file=sys.stderr)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] if (
        out / "metrics.jsonl").exists() else []
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return code, records, summary


_CONTEXT = []


def _context():
    if not _CONTEXT:
        context = multiprocessing.get_context("forkserver")
        # and what every run imports later: torch._dynamo (the optimizer's constructor), the plot's matplotlib
        context.set_forkserver_preload(["torch", "accelerate", "datasets", "mixprec.training", "mixprec.models",
                                        "torch._dynamo", "matplotlib.figure", "PIL.Image"])
        _CONTEXT.append(context)
    return _CONTEXT[0]


def _with_fix(args: list[str], fix: str) -> list[str]:
    """The arguments with the advised flags set (replacing the flag's value where it was given)."""
    words = shlex.split(fix)
    args = list(args)
    for flag, value in zip(words[::2], words[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


def _onset(s: Scenario, records: list[dict]) -> int | None:
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r and "event" not in r and "val_loss" not in r]
    if s.onset == "rise":
        if not losses:
            return None
        first = losses[0][1]
        return next((step for step, loss in losses if loss > first), None)
    if s.onset == "jump":
        return next((step for step, loss in losses if losses and loss > 2 * losses[0][1]), None)
    if s.onset == "nonfinite":
        return next((step for step, loss in losses if not math.isfinite(float(loss))), None)
    return s.onset


def run_scenario(s: Scenario, root: Path) -> dict:
    folder = root / s.name
    folder.mkdir(parents=True)
    extra = s.data(folder) if s.data else []
    args = [*s.args, *extra, "--output_dir", str(folder / "run")]
    started = time.perf_counter()
    code, records, summary = _train(s.name, args, True)
    events = [r for r in records if "event" in r]
    row = {"scenario": s.name, "expected": s.cause or "(none)", "exit": code, "events": len(events),
           "first": events[0] if events else None}
    if s.cause is None:
        problem = s.check(summary) if code == 0 else f"exit code {code}"
        said = ", ".join(sorted({e["event"] for e in events}))
        row.update(false_alarms=len(events), ok=not events and not problem, note=problem, said=said)
        if s.known:  # counted apart: it must raise just the known events (else docs/health.md is out of date)
            row.update(known=s.known, false_alarms=0, ok=said == s.known and code == 0,
                       note=f"val_accuracy {summary.get('val_accuracy')}")
    else:
        first = events[0] if events else {}
        onset = _onset(s, records)
        causes = {e.get("cause", "") for e in events}
        row.update(false_alarms=0, said=first.get("cause", "(nothing)"), onset=onset,
                   cause_ok=bool(events) and causes == {s.cause},
                   module_ok=s.module is None or s.module in first.get("modules", "").split(","),
                   delay=first["step"] - onset if events and onset is not None else None,
                   fix=first.get("fix", ""))
        row["fix_ok"], row["note"] = _check_fix(s, root, args, row["fix"]) if events else (False, "no event")
        row["ok"] = row["cause_ok"] and row["module_ok"] and row["fix_ok"] and row["delay"] is not None and \
            0 <= row["delay"] <= MAX_DELAY
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def _check_fix(s: Scenario, root: Path, args: list[str], fix: str) -> tuple[bool, str]:
    """Rerun with the advised change: the problem is gone when the run completes without an event."""
    folder = root / (s.name + "-fixed")
    folder.mkdir()
    args = [a for a in args if a != "--output_dir"]
    args = args[:-1] + ["--output_dir", str(folder / "run")]
    fault = True
    if fix.startswith("--"):
        args = _with_fix(args, fix)
    elif fix.startswith("data:") and s.fixed_data:
        file = args.index("--train_file")
        args[file + 1] = s.fixed_data(folder)[-1]
    elif fix.startswith("code:") and s.fault:
        fault = False
    else:
        return False, f"no way to apply {fix!r}"
    code, records, _ = _train(s.name, args, fault)
    left = [r["event"] for r in records if "event" in r]
    return code == 0 and not left, ("" if code == 0 and not left else f"after the fix: exit {code}, events {left}")


def render(rows: list[dict], machine: str, seconds: float) -> str:
    known = [r for r in rows if r.get("known")]
    healthy = [r for r in rows if r["expected"] == "(none)" and not r.get("known")]
    sick = [r for r in rows if r["expected"] != "(none)"]
    lines = [f"# Diagnosis benchmark\n\n`python benchmarks/diagnosis.py` on {machine}, {seconds:.0f} s.\n",
             "| scenario | expected cause | said | events | onset | steps to event | module | fix | fix works | ok |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("known"):
            verdict = "as known" if r["ok"] else "NO: not as documented"
            lines.append(f"| {r['scenario']} | (none: a known false alarm) | {r['said'] or '(nothing)'} | "
                         f"{r['events']} | | | | | | {verdict} ({r['note']}) |")
        elif r["expected"] == "(none)":
            lines.append(f"| {r['scenario']} | (none) | {r['said'] or '(nothing)'} | {r['events']} | | | | | | "
                         f"{'yes' if r['ok'] else 'NO ' + r['note']} |")
        else:
            lines.append(f"| {r['scenario']} | {r['expected']} | {r['said']} | {r['events']} | {r['onset']} | "
                         f"{r['delay']} | {'yes' if r['module_ok'] else 'NO'} | `{r['fix']}` | "
                         f"{'yes' if r['fix_ok'] else 'NO ' + r['note']} | {'yes' if r['ok'] else 'NO'} |")
    delays = [r["delay"] for r in sick if r.get("delay") is not None]
    lines.append(f"\nFalse alarms: {sum(r['false_alarms'] for r in healthy)} in {len(healthy)} healthy runs. "
                 f"Causes right: {sum(r['cause_ok'] for r in sick)} of {len(sick)}. Fixes that work: "
                 f"{sum(r['fix_ok'] for r in sick)} of {len(sick)}. Steps from onset to the first event: "
                 f"{sorted(delays)} (within {MAX_DELAY}: {sum(0 <= d <= MAX_DELAY for d in delays)} of {len(sick)}).")
    if known:
        lines.append(f"Known false alarms, counted apart (docs/health.md, \"Known false alarms\"): "
                     f"{', '.join(r['scenario'] + ' (' + r['said'] + ')' for r in known)}.")
    lines.append("\nEvery run logs each step (`--log_every 1`): `lost_updates` is measured on logging steps only, so with "
                 "the default `--log_every 50` it comes at the first logging step. Shuffled labels are said after the "
                 "first step by the label probe (`labels_unrelated`: the gradient's label-dependent part is no larger "
                 "with the rows' labels than with them shuffled), not at the end of a `--flat_loss_window` (40 here); "
                 "a learning rate far too low is said at the first step.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated scenario names (default: all)")
    parser.add_argument("--out", help="also write the table to this Markdown file")
    a = parser.parse_args(argv)
    chosen = [s for s in scenarios() if not a.only or s.name in a.only.split(",")]
    from mixprec.devices.hardware import cpu_flags, cpu_name, machine_line

    flags = cpu_flags()
    machine = (f"{machine_line()} ({cpu_name()}; AVX512-BF16 {'yes' if 'avx512_bf16' in flags else 'no'}, AMX "
               f"{'yes' if 'amx_bf16' in flags else 'no'})")
    started, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        for s in chosen:
            rows.append(run_scenario(s, Path(tmp)))
            print(f"{s.name}: {'ok' if rows[-1]['ok'] else 'NOT OK'} ({rows[-1]['seconds']} s)", file=sys.stderr)
    text = render(rows, machine, time.perf_counter() - started)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return rows


if __name__ == "__main__":
    main()
