"""What recipes/precision_diff.py runs: its own flags on top of recipes/train.py's, checked before torch
loads; the model, weights and batches (as the precision report gets them); the diff; its files."""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from .. import config
from ..config.arg_parser import Parser
from ..errors import UsageError

PRECISIONS = ("no", "fp16", "bf16", "fp8")
SIMULATE = ("auto", "always", "never")
FP8_RECIPES = ("tensorwise", "rowwise")
MAX_STEPS = 1000


def own_parser() -> argparse.ArgumentParser:
    parser = Parser(add_help=False)
    parser.add_argument("--compare", default="no,bf16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--simulate", default="auto")
    parser.add_argument("--fp8_recipe", default="tensorwise")
    return parser


def check_own(own: argparse.Namespace) -> argparse.Namespace:
    pair = [p.strip() for p in own.compare.split(",")]
    if len(pair) != 2 or any(p not in PRECISIONS for p in pair) or pair[0] == pair[1]:
        raise UsageError(f"--compare {own.compare!r} must name two different precisions of {', '.join(PRECISIONS)}, "
                         f"the reference first: e.g. --compare no,bf16")
    own.compare = tuple(pair)
    if not 0 < own.steps <= MAX_STEPS:
        raise UsageError(f"--steps {own.steps} must be between 1 and {MAX_STEPS}")
    if own.simulate not in SIMULATE:
        raise UsageError(f"--simulate {own.simulate!r} is not one of {', '.join(SIMULATE)}: pick one of those")
    if own.fp8_recipe not in FP8_RECIPES:
        raise UsageError(f"--fp8_recipe {own.fp8_recipe!r} is not one of {', '.join(FP8_RECIPES)}")
    if "fp8" in own.compare and own.simulate == "never":
        raise UsageError("--compare with fp8 runs simulated fp8 only (real fp8 needs torchao or TransformerEngine on "
                         "an fp8 GPU): use --simulate auto")
    return own


def parse(argv: list[str], description: str):
    """(config, own flags, weights file or None, where the model settings came from). --help and flag errors
    answer before torch loads."""
    own, rest = own_parser().parse_known_args(argv)
    cfg = config.parse_config(rest, description=description)
    own = check_own(own)
    from ..run_folder import run_loading as inputs  # torch, datasets

    cfg, weights, source = inputs.with_weights(cfg, rest)
    return cfg, own, weights, source


def side(name: str, mode: str, device_type: str, fp8_recipe: str):
    """How `name` is computed here: simulated where --simulate says so (auto: where the CPU has no native
    support; real autocast on GPUs), with the line that says it."""
    from ..devices import hardware
    from ..formats import simulate
    from .diff import Side

    if name == "no":
        return Side(name, False, simulate.describe(name, False))
    if name == "fp8":
        return Side(name, True, simulate.describe(name, True, fp8_recipe=fp8_recipe))
    native, why = hardware.cpu_native(name) if device_type == "cpu" else (True, f"{device_type} runs {name} natively")
    if mode == "always" or (mode == "auto" and not native):
        reason = f"this CPU has no native {name}: {why}" if not native else "--simulate always"
        return Side(name, True, simulate.describe(name, True, reason))
    reason = why if native else f"emulated by this CPU, slow: {why}"
    return Side(name, False, simulate.describe(name, False, reason))


def output_dir(cfg) -> Path:
    if cfg.output_dir:
        return Path(cfg.output_dir)
    return Path("reports") / f"diff-{cfg.model}-{cfg.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"


def run(cfg, own, weights, source, argv: list[str]) -> tuple[dict, Path]:
    """Build, check, diff; nothing is written before every input is checked. Returns (result, folder)."""
    import torch

    from ..devices import hardware
    from ..run_folder import run_loading as inputs
    from ..evaluation import loss_fn
    from . import diff
    from ..precision import policy

    if "auto" in cfg.fp32_modules:
        raise UsageError("--fp32_modules auto chooses modules when training (recipes/train.py prints and records "
                         "them in config.yaml's effective.fp32_plan): give those names here to compare with them")
    device, model, batches = inputs.prepare(cfg, weights, own.steps)
    matched = policy.match(model, cfg.fp32_modules, f"--model {cfg.model}")
    sides = tuple(side(p, own.simulate, device.type, own.fp8_recipe) for p in own.compare)
    if len(batches) < own.steps:
        raise UsageError(f"--steps {own.steps}: the training set has only {len(batches)} batches of "
                         f"{cfg.batch_size}: lower --steps or --batch_size")
    meta = {"model": cfg.model, "model_args": cfg.model_args, "dataset": cfg.dataset, "settings_from": source,
            "weights": inputs.weights_label(cfg, cfg.seed, weights),
            "num_parameters": sum(p.numel() for p in model.parameters()), "compare": list(own.compare),
            "how": {s.name: s.how for s in sides}, "simulated": {s.name: s.simulated for s in sides},
            "simulate": own.simulate, "fp8_recipe": own.fp8_recipe, "steps": own.steps,
            "batch_size": cfg.batch_size, "fp32_modules": matched, "hardware": hardware.machine_line(),
            "device": hardware.device_name(device), "torch": torch.__version__,
            "command": "python recipes/precision_diff.py " + " ".join(map(shlex.quote, argv))}
    say = (lambda k, a, b: print(f"step {k}/{own.steps}: loss {own.compare[0]} {a:.6g}, {own.compare[1]} {b:.6g}",
                                 file=sys.stderr, flush=True))
    result = diff.run(cfg.optim, cfg.precision, model, batches, loss_fn, device, sides, policy.names_of(matched),
                      own.fp8_recipe, progress=say)
    return {"meta": meta, **result}, output_dir(cfg)


def write(result: dict, out: Path) -> list[Path]:
    from . import render

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "diff.json", out / "diff.md", out / "diff.png"]
    render.write_json(result, paths[0])
    from ..run_folder.checkpointing import write_atomic

    write_atomic(paths[1], render.markdown(result))
    render.plot(result, paths[2])
    return paths
