"""metrics.png: a run's curves over optimizer steps, drawn from its metrics.jsonl with matplotlib (no display).

Six panels: training and validation loss, the other validation metrics, learning rate, loss scale (with the
steps the GradScaler skipped; without a GradScaler, the share of lost updates: mixprec.precision.lost_updates), gradient
norm, throughput. A panel without data says why. Redraw any run:

    python -m mixprec.tracking.plots runs/NAME              # writes runs/NAME/metrics.png
    python -m mixprec.tracking.plots runs/NAME -o curves.png
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
from pathlib import Path

import yaml

from ..errors import UsageError, exit_on_usage_error, name_the_file
from .jsonl import read_records

PNG = "metrics.png"


def _xy(records: list[dict], key: str) -> tuple[list, list]:
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _empty(ax, title: str, note: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, note, ha="center", va="center", wrap=True, color="0.4", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _lines(ax, title: str, series: list[tuple[str, list[dict], str]], note: str, log: bool = False) -> bool:
    """One panel of (label, records, key) lines; `note` when none has data. Returns whether it drew."""
    drawn = False
    for label, records, key in series:
        xs, ys = _xy(records, key)
        if xs:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
            drawn = True
    if not drawn:
        _empty(ax, title, note)
        return False
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)
    ys = [y for line in ax.get_lines() for y in line.get_ydata() if math.isfinite(y)]
    if log and ys and min(ys) > 0 and max(ys) / min(ys) > 20:  # a log axis only where it helps
        ax.set_yscale("log")
    ax.legend(fontsize="small")
    return True


EVENT_COLORS = ("tab:red", "tab:purple", "tab:brown", "tab:olive", "tab:cyan", "tab:pink")


def _events(ax, events: list[dict]) -> None:
    """Health events as ticks along the top of the panel: one colour and one legend entry per kind, however
    many there are (text labels would pile up)."""
    kinds = sorted({str(e["event"]) for e in events})
    for kind, color in zip(kinds, EVENT_COLORS * 2):
        steps = [e["step"] for e in events if e["event"] == kind]
        ax.plot(steps, [0.97] * len(steps), "v", color=color, markersize=7, transform=ax.get_xaxis_transform(),
                label=f"{kind} ({len(steps)})", clip_on=False)
    if kinds:
        ax.legend(fontsize="small")


def _title(run_dir: Path) -> str:
    title = run_dir.resolve().name
    try:
        effective = yaml.safe_load((run_dir / "config.yaml").read_text())["effective"]
        scaler = "off" if effective["grad_scaler"] == "off" else "on"
        processes = f"{effective['world_size']} process" + ("es" if effective["world_size"] > 1 else "")
        title += (f": {effective['effective_precision']} (autocast {effective['autocast_dtype']}, GradScaler "
                  f"{scaler}), {processes} on {effective['device']}")
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        pass
    return title


def plot_run(run_dir: Path, path: Path | None = None) -> Path:
    """Draw `run_dir`/metrics.jsonl into `path` (default `run_dir`/metrics.png), atomically. Returns the path."""
    from matplotlib.figure import Figure  # no pyplot: no display, no global state

    run_dir = Path(run_dir)
    path = Path(path) if path else run_dir / PNG
    records = read_records(run_dir / "metrics.jsonl")
    train = [r for r in records if "loss" in r and "event" not in r]
    evals = [r for r in records if any(k.startswith("val_") for k in r)]
    events = [r for r in records if "event" in r]

    fig = Figure(figsize=(14, 7.5), dpi=90)
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.07, top=0.91, wspace=0.22, hspace=0.32)  # fixed: fast
    (loss, val, lr), (scale, norm, speed) = fig.subplots(2, 3)
    if _lines(loss, "loss", [("train (mean over the logging window)", train, "loss"),
                             ("validation", evals, "val_loss")], "no loss logged yet", log=True):
        _events(loss, events)
    other = sorted({k for r in evals for k in r if k.startswith("val_") and k != "val_loss"})
    _lines(val, "validation metrics", [(k.removeprefix("val_"), evals, k) for k in other], "no evaluation yet")
    _lines(lr, "learning rate", [("lr", train, "lr")], "no learning rate logged")
    if not _xy(train, "loss_scale")[0] and _xy(train, "lost_update_share")[0]:  # no GradScaler: lost updates
        _lines(scale, "lost updates (no GradScaler in this run)",
               [("share of non-zero updates that left the weight unchanged", train, "lost_update_share")], "")
        scale.set_ylim(-0.02, 1.02)
    elif _lines(scale, "loss scale (GradScaler)", [("loss scale", train, "loss_scale")],
                "no GradScaler in this run\n(fp32 and bf16 need no loss scaling)"):
        scale.set_yscale("log", base=2)
        skipped = [r for prev, r in zip([{"skipped_steps": 0}] + train, train)
                   if r.get("skipped_steps", 0) > prev.get("skipped_steps", 0) and "loss_scale" in r]
        if skipped:
            scale.plot([r["step"] for r in skipped], [r["loss_scale"] for r in skipped], "x", color="tab:red",
                       label="steps skipped in the window (inf/NaN gradients)")
            scale.legend(fontsize="small")
    _lines(norm, "gradient norm (before clipping)", [("grad norm", train, "grad_norm")], "no gradient norm logged",
           log=True)
    _lines(speed, "throughput", [(k.replace("_", " "), train, k) for k in ("samples_per_s", "tokens_per_s")],
           "no throughput logged")
    fig.suptitle(_title(run_dir))
    return save_png(fig, path)


def save_png(fig, path: Path) -> Path:
    """`fig` as a PNG of a 256-colour palette (the same picture in a third of the bytes), written whole or not at
    all: no temporary file left behind (a full disk, a read-only folder)."""
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    buffer.seek(0)
    with Image.open(buffer) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        small.save(tmp, format="PNG")
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        name_the_file(err, path)
        raise
    return path


@exit_on_usage_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a run folder (holds metrics.jsonl)")
    parser.add_argument("-o", "--output", type=Path, help=f"the PNG to write (default: RUN_DIR/{PNG})")
    args = parser.parse_args(argv)
    if not (args.run_dir / "metrics.jsonl").is_file():
        raise UsageError(f"'{args.run_dir}' holds no metrics.jsonl: give a run folder (runs/NAME)")
    print(plot_run(args.run_dir, args.output))


if __name__ == "__main__":
    main()
