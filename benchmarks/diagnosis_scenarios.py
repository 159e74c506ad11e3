"""The diagnosis benchmark's scenarios: real runs of recipes/train.py, healthy ones (no event may be raised)
and unhealthy ones, each with the cause the health checks must name, the module where there is one, the step
where the problem begins, and how the advised fix is applied when it is a change by hand ("data: ..." and
"code: ..." fixes; flag fixes are applied to the arguments).

Faults that no flag makes (a layer initialised to explode, one that overflows fp16 in the forward pass, one whose
backward exceeds fp16's range) are made from outside the product, on the model `mixprec.models.build` returns:
the product knows nothing of them.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "configs"
STEPS = ["--log_every", "1", "--report_to", "none", "--sample_tokens", "0", "--warmup_steps", "5"]
MLP = ["--model", "mlp", "--model_args", "hidden=[64,32]", *STEPS]
CNN = ["--config", str(CONFIGS / "cnn_digits.yaml"), "--max_steps", "12", "--batch_size", "32", *STEPS]
# The CNN in fp16 shrunk as tests/matrix.py shrinks it (2 stages of 8 and 16 channels, 16 px images): the full
# model's fp16 convolutions take about 5 s a step at batch 32 on an Intel Xeon with AVX512-FP16 (oneDNN's fp16
# weight gradients), and the two fp16 scenarios below were 60% of the benchmark's time there.
CNN_FP16 = [*CNN, "--model_args", "widths=[8,16],blocks=[1,1]", "--dataset_args", "image_size=16"]
GPT = ["--config", str(CONFIGS / "gpt_tiny.yaml"), "--max_steps", "15",
       "--dataset_args", "max_val_samples=32", "--batch_size", "8", *STEPS]


def table(path: Path, rows: int = 1600, features: int = 20, classes: int = 4, scale: float = 1.0,
          bad: dict[int, float] | None = None, noise: float = 0.0, shuffle: bool = False, drop_bad: bool = False,
          xor: bool = False) -> Path:
    """A learnable CSV table (Gaussian class clusters) with the chosen faults: `bad` puts a value (NaN, inf, a
    sentinel such as 1e4) into those rows; `noise` relabels that share at random; `shuffle` permutes the labels
    (nothing to learn); `xor`: the XOR of the signs of the first two features (learnable, by no single feature)."""
    rng = np.random.default_rng(7)
    centres = rng.standard_normal((classes, features)) * 2.0
    labels = rng.integers(0, classes, rows)
    x = (centres[labels] + rng.standard_normal((rows, features))) * scale
    if xor:
        x = rng.standard_normal((rows, features)) * scale
        labels = ((x[:, 0] > 0) ^ (x[:, 1] > 0)).astype(int)
    if noise:
        flip = rng.random(rows) < noise
        labels = np.where(flip, rng.integers(0, classes, rows), labels)
    if shuffle:
        labels = rng.permutation(labels)
    keep = [i for i in range(rows) if not (drop_bad and bad and i in bad)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([f"f{j}" for j in range(features)] + ["label"])
        for i in keep:
            row = list(x[i])
            if bad and i in bad and not drop_bad:
                row[3] = bad[i]
            w.writerow(row + [int(labels[i])])
    return path


def data(**kw) -> Callable[[Path], list[str]]:
    def make(folder: Path) -> list[str]:
        return ["--dataset", "file", "--train_file", str(table(folder / "train.csv", **kw))]
    return make


def scale_layers(factors: dict[str, float]) -> Callable[[torch.nn.Module], None]:
    def fault(model):
        with torch.no_grad():
            for name, factor in factors.items():
                for p in model.get_submodule(name).parameters():
                    p.mul_(factor)
    return fault


def backward_gain(name: str, factor: float) -> Callable[[torch.nn.Module], None]:
    """The gradient flowing back out of `name` is multiplied by `factor` in its own dtype (fp16 overflows)."""
    def fault(model):
        model.get_submodule(name).register_full_backward_pre_hook(lambda m, g: tuple(
            None if t is None else t * torch.tensor(factor, dtype=t.dtype) for t in g))
    return fault


@dataclass
class Scenario:
    name: str
    args: list[str]
    cause: str | None = None  # None: healthy, no event may be raised
    module: str | None = None  # the module the event must name
    onset: int | str = 1  # the step where the problem begins, or "rise" / "jump" (twice the first) / "nonfinite":
    # found in the run's losses
    data: Callable[[Path], list[str]] | None = None  # writes the scenario's files, gives their flags
    fault: Callable[[torch.nn.Module], None] | None = None
    fixed_data: Callable[[Path], list[str]] | None = None  # the "data: ..." fix applied by hand
    check: Callable[[dict], str] = field(default=lambda summary: "")  # a healthy run's extra check: "" or a failure
    known: str = ""  # a healthy run with a known false alarm (docs/health.md): the events it raises, counted apart
    quick: bool = False


def converged(summary: dict) -> str:
    return "" if summary.get("val_accuracy") == 1.0 else f"val_accuracy {summary.get('val_accuracy')}, not 1.0"


def scenarios() -> list[Scenario]:
    healthy = [Scenario(f"{m}-{p}", [*(CNN_FP16 if (m, p) == ("cnn", "fp16") else args), "--mixed_precision", p],
                        quick=(m, p) == ("mlp", "fp16"))
               for m, args in (("mlp", [*MLP, "--max_steps", "60"]), ("cnn", CNN), ("gpt_tiny", GPT))
               for p in ("no", "bf16", "fp16")]
    healthy += [
        Scenario("converged-to-zero-gradients", [*MLP, "--mixed_precision", "no", "--max_steps", "1000", "--lr", "3e-3",
                                                 "--lr_schedule", "constant"],
                 data=data(rows=800, classes=4), check=converged),
        Scenario("noisy-labels", [*MLP, "--mixed_precision", "bf16", "--max_steps", "200"], data=data(noise=0.3)),
        Scenario("tiny-dataset", [*MLP, "--mixed_precision", "no", "--max_steps", "100"], data=data(rows=40)),
        Scenario("xor-of-two-features", [*MLP, "--mixed_precision", "no", "--max_steps", "300"],
                 data=data(classes=2, xor=True), known="labels_unrelated"),  # the label probe's first-order limit
        Scenario("long-run", [*MLP, "--mixed_precision", "fp16", "--max_steps", "1500", "--log_every", "50"],
                 data=data(rows=4000, noise=0.1)),
    ]
    fp32 = [*MLP, "--mixed_precision", "no", "--max_steps", "40"]
    fp16 = [*MLP, "--mixed_precision", "fp16", "--max_steps", "40"]
    unhealthy = [
        Scenario("lr-far-too-high", [*fp32, "--lr", "0.5"], "lr_too_high", onset="rise",
                 data=data(), quick=True),
        Scenario("lr-far-too-low", [*MLP, "--mixed_precision", "no", "--max_steps", "60", "--lr", "1e-7",
                                    "--flat_loss_window", "40"], "lr_too_low", data=data()),
        Scenario("nan-in-a-data-row", [*fp32, "--allow_nonfinite_data"], "nonfinite_data", onset="nonfinite",
                 data=data(bad={100: float("nan")}), fixed_data=data(bad={100: float("nan")}, drop_bad=True),
                 quick=True),
        Scenario("inf-in-a-data-row", [*fp32, "--allow_nonfinite_data"], "nonfinite_data", onset="nonfinite",
                 data=data(bad={300: float("inf")}), fixed_data=data(bad={300: float("inf")}, drop_bad=True)),
        Scenario("one-row-far-outside-the-others", fp32, "outlier_data", onset="jump",
                 data=data(bad={300: 1e4}), fixed_data=data(bad={300: 1e4}, drop_bad=True)),
        Scenario("huge-input-features", fp32, "input_scale", data=data(scale=1e4), fixed_data=data()),
        Scenario("fp16-forward-overflow", [*CNN_FP16, "--mixed_precision", "fp16"], "fp16_forward_overflow", "stem.0",
                 fault=scale_layers({"stem.0": 1e5})),  # the batch norm after it takes the scale out in fp32
        Scenario("fp16-gradient-underflow", [*fp16, "--init_scale", str(2.0 ** -30)], "fp16_grad_underflow",
                 data=data()),
        Scenario("collapsing-loss-scale", [*fp16, "--max_steps", "30"], "loss_scale_collapse", "net.2", data=data(),
                 fault=backward_gain("net.2", 2.0 ** 20)),
        Scenario("lost-updates-bf16-round", [*MLP, "--max_steps", "20", "--mixed_precision", "bf16",
                                             "--master_weights", "bf16", "--bf16_update", "round", "--lr", "1e-5"],
                 "lost_updates", data=data()),
        Scenario("layer-initialised-to-explode", fp32, "layer_init", "net.2", data=data(),
                 fault=scale_layers({"net.2": 300.0})),
        Scenario("shuffled-labels", [*MLP, "--mixed_precision", "bf16", "--max_steps", "60", "--flat_loss_window",
                                     "40"], "no_signal", data=data(shuffle=True), fixed_data=data()),
    ]
    return healthy + unhealthy
