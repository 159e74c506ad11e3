"""fp8 readiness on any CPU: what fp8 training would do to each Linear layer's operands, simulated by casting
the real values to torch's float8 dtypes with the fp8 libraries' scaling recipes (mixprec.formats.fp8). A
simulation of fp8 numerics, not of fp8 speed: nothing here runs an fp8 matmul or says how fast one would be.

For every nn.Linear layer, on the fp32 pass of the report's batches (forward hooks; a hook on each output
for its gradient): the weight, the layer's input (the activations) and the gradient of its output, each
sent through E4M3 and E5M2 with
- tensorwise: one scale per tensor from its own amax (torchao's tensorwise recipe, Accelerate's AO default;
  TransformerEngine's current scaling);
- delayed: one scale per tensor from the amax of the previous batch (TransformerEngine's delayed scaling;
  the first batch uses its own): a value above that amax saturates, counted as an overflow;
- rowwise: one power-of-two scale per row (torchao's rowwise recipe);
and measured: the share of nonzero values flushed to zero, the share that overflows (saturates), the SQNR of
the round trip, 10 log10(sum x^2 / sum (x - fp8(x))^2) in dB, and the share of values lost (flushed or
saturated) in the worst channel: per output channel for the weight (a row), per feature for the input and the
output gradient (a column). The SQNR of a whole tensor is ruled by its largest values: one outlier weight
that sets a tensorwise scale can flush a third of the others to zero and leave the SQNR above 30 dB; the
share lost shows it.

The GEMMs of a Linear layer with M tokens per batch, K inputs and N outputs: forward (M x K)(K x N), input
gradient (M x N)(N x K), weight gradient (N x M)(M x K). torch._scaled_mm takes them when K and N (and, for
the weight gradient, M) divide by 16; Accelerate converts a Linear layer only when K and N do, and torchao
pads M (pad_inner_dim, Accelerate's default).

The exclusion list: the first and the last Linear layer (Accelerate's and torchtitan's rule), and every layer
with an operand, in the recipe Accelerate's AO backend runs (tensorwise; weight and input E4M3, output
gradient E5M2), below the SQNR threshold, or losing more than LOST_THRESHOLD of its nonzero values (flushed to
zero or saturated), or, for the weight, more than CHANNEL_LOST_THRESHOLD of one output channel's (an input's or
output gradient's worst feature is shown, not judged: after a ReLU a feature can hold a handful of nonzero
values); the reason says what rowwise scaling (one scale per row, torchao's rowwise recipe) would lose instead. It is written as recipes/train.py's `--fp32_modules` flag (with fp8 on
torchao, train.py keeps those layers out of fp8 and computes them in fp32) and as a ready Accelerate config
file: Accelerate's config has no key for an exclusion list, so the file carries the launch command with it.
"""
from __future__ import annotations

import contextlib
import json
import shlex

import torch

from ..formats import fp8 as q8

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config.sections import DataSettings, ModelSettings, OptimSettings

FORMATS = tuple(q8.FORMATS)  # e4m3, e5m2
RECIPES = ("tensorwise", "delayed", "rowwise")
TENSORS = ("weight", "input", "grad_output")
TRAINING = {"weight": "e4m3", "input": "e4m3", "grad_output": "e5m2"}  # tensorwise (Accelerate's AO default)
SQNR_THRESHOLD = 20.0  # dB
LOST_THRESHOLD = 0.01  # of a tensor's nonzero values flushed to zero or saturated: out of fp8
CHANNEL_LOST_THRESHOLD = 0.10  # of one output channel's nonzero weights
MULTIPLE = q8.GEMM_MULTIPLE
OVERFLOW_TOL = 1e-6  # |x * scale| this far above the format's max: an amax scale's own rounding is not an overflow
CONFIG_FILE = "fp8_accelerate_config.yaml"
SIMULATED = ("simulated fp8 numerics (values cast to torch float8 dtypes on this machine), not fp8 speed: "
             "nothing here runs an fp8 matmul")


class Stream:
    """x -> fp8 -> x for one tensor, one format, one recipe, batch after batch."""

    def __init__(self, fmt: str, recipe: str, by_row: bool = False):
        self.fmt, self.recipe, self.by_row = fmt, recipe, by_row  # channels: rows (a weight) or columns
        self.n = self.nonzero = self.flushed = self.overflow = 0
        self.err_sq = self.ref_sq = 0.0
        self.prev_amax = None
        self.channel_lost = self.channel_nonzero = None

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().float()
        amax = x.abs().max() if x.numel() else torch.zeros(())
        use = self.prev_amax if self.recipe == "delayed" and self.prev_amax is not None else None
        scale = q8.scale_for(x, self.fmt, "tensorwise" if self.recipe == "delayed" else self.recipe, use)
        top = torch.finfo(q8.FORMATS[self.fmt]).max
        scaled = x * scale
        q = scaled.clamp(-top, top).to(q8.FORMATS[self.fmt]).float()
        nz = x != 0
        flushed, over = nz & (q == 0), scaled.abs() > top * (1 + OVERFLOW_TOL)
        self.n += x.numel()
        self.nonzero += int(nz.sum())
        self.flushed += int(flushed.sum())
        self.overflow += int(over.sum())
        if x.dim() == 2:
            dim = 1 if self.by_row else 0
            lost, nonzero = (flushed | over).sum(dim).double(), nz.sum(dim).double()
            if self.channel_lost is None or self.channel_lost.shape != lost.shape:
                self.channel_lost, self.channel_nonzero = lost, nonzero
            else:
                self.channel_lost, self.channel_nonzero = self.channel_lost + lost, self.channel_nonzero + nonzero
        self.err_sq += (q / scale - x).double().pow(2).sum().item()
        self.ref_sq += x.double().pow(2).sum().item()
        self.prev_amax = amax

    def result(self) -> dict:
        worst = 0.0
        if self.channel_lost is not None and bool((self.channel_nonzero > 0).any()):
            used = self.channel_nonzero > 0
            worst = (self.channel_lost[used] / self.channel_nonzero[used]).max().item()
        return {"values": self.n, "flushed_to_zero": self.flushed / max(self.nonzero, 1),
                "overflow": self.overflow / max(self.n, 1), "sqnr_db": q8.sqnr_db(self.err_sq, self.ref_sq),
                "lost": (self.flushed + self.overflow) / max(self.nonzero, 1), "worst_channel_lost": worst}


class Layer:
    def __init__(self, module: torch.nn.Linear):
        self.module, self.tokens = module, []
        self.streams = {t: {f: {r: Stream(f, r, by_row=t == "weight") for r in RECIPES} for f in FORMATS}
                        for t in TENSORS}

    def add(self, tensor: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        for by_recipe in self.streams[tensor].values():
            for stream in by_recipe.values():
                stream.add(x)


@contextlib.contextmanager
def collect(model: torch.nn.Module, layers: dict):
    """Forward hooks on every nn.Linear: its input, and (a hook on its output) its output's gradient, go through
    every format and recipe. Only passes with gradients count (the report's fp32 pass)."""
    def hook(name):
        def fn(module, inputs, output):
            if not torch.is_grad_enabled() or not inputs or not isinstance(output, torch.Tensor):
                return
            layer = layers.setdefault(name, Layer(module))
            x = inputs[0].detach()
            layer.tokens.append(x.numel() // max(x.shape[-1], 1))
            layer.add("input", x)
            if output.requires_grad:
                output.register_hook(lambda grad: layer.add("grad_output", grad.detach()))
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)]
    try:
        yield layers
    finally:
        for h in handles:
            h.remove()


def gemms(m: int, k: int, n: int) -> tuple[dict, list[str]]:
    """The three GEMMs of a Linear layer and the dimensions torch._scaled_mm needs divisible by 16 that are not."""
    shapes = {"forward": f"({m}x{k})({k}x{n})", "input_gradient": f"({m}x{n})({n}x{k})",
              "weight_gradient": f"({n}x{m})({m}x{k})"}
    bad = [f"{what} {size}" for what, size in (("in_features", k), ("out_features", n), ("tokens per batch", m))
           if size % MULTIPLE]
    return shapes, bad


def layer_rows(model: torch.nn.Module, layers: dict) -> list[dict]:
    """One row per Linear layer the batches ran, in the order of model.named_modules()."""
    converted = q8.converted_linears(model)  # Accelerate's own rule: None, or why it is left out
    rows = []
    for name in [n for n in converted if n in layers]:
        layer = layers[name]
        weight = Layer(layer.module)  # once: the weights are the same for every batch (delayed = tensorwise)
        weight.add("weight", layer.module.weight.detach())
        streams = {**layer.streams, "weight": weight.streams["weight"]}
        stats = {t: {f: {r: s.result() for r, s in by_recipe.items()} for f, by_recipe in streams[t].items()}
                 for t in TENSORS}
        k, n = layer.module.in_features, layer.module.out_features
        shapes, bad = gemms(max(layer.tokens, default=0), k, n)
        training = {t: stats[t][TRAINING[t]]["tensorwise"]["sqnr_db"] for t in TENSORS}
        lost = {t: {k: stats[t][TRAINING[t]]["tensorwise"][k] for k in ("lost", "worst_channel_lost")}
                for t in TENSORS}
        rows.append({"layer": name, "in_features": k, "out_features": n, "tokens": sorted(set(layer.tokens)),
                     "gemms": shapes, "not_divisible_by_16": bad, "accelerate_converts": converted.get(name) is None,
                     "accelerate_leaves_out": converted.get(name), **stats, "training_sqnr_db": training,
                     "min_training_sqnr_db": min(training.values()), "training_lost": lost})
    return rows


def exclusions(model: torch.nn.Module, rows: list[dict], threshold: float) -> list[dict]:
    """The first and last Linear layers (as Accelerate finds them), and each layer with an operand below
    `threshold` dB in the recipe Accelerate runs (tensorwise), in the order of model.named_modules()."""
    from accelerate.utils.ao import find_first_last_linear_layers

    first, last = find_first_last_linear_layers(model)
    by_name = {r["layer"]: r for r in rows}
    out = []
    for name in q8.converted_linears(model):
        reasons = (["first Linear layer"] if name == first else []) + (["last Linear layer"] if name == last else [])
        sqnr = by_name[name]["training_sqnr_db"] if name in by_name else {}
        low = [f"{t} {TRAINING[t].upper()} {db:.1f} dB" for t, db in sqnr.items() if db < threshold]
        if low:
            reasons.append(f"SQNR below {threshold:g} dB: {', '.join(low)}")
        if name in by_name:
            reasons += lost_reasons(by_name[name])
        if reasons:
            out.append({"layer": name, "reasons": reasons})
    return out


def lost_reasons(row: dict) -> list[str]:
    """Each operand that loses too many of its values in the training recipe (tensorwise), over the whole
    tensor or (the weight) in one output channel, with what rowwise scaling would lose instead."""
    out = []
    for t in TENSORS:
        got = row["training_lost"][t]
        channel_bad = t == "weight" and got["worst_channel_lost"] > CHANNEL_LOST_THRESHOLD
        if got["lost"] <= LOST_THRESHOLD and not channel_bad:
            continue
        fmt = TRAINING[t]
        flushed, over = (row[t][fmt]["tensorwise"][k] for k in ("flushed_to_zero", "overflow"))
        rowwise = row[t][fmt]["rowwise"]
        channel = "output channel" if t == "weight" else "feature"
        out.append(f"{t} {fmt.upper()} tensorwise loses {got['lost']:.1%} of its values ({flushed:.1%} flushed to "
                   f"zero, {over:.1%} saturated), {got['worst_channel_lost']:.1%} in its worst {channel} "
                   f"(rowwise scaling: {rowwise['lost']:.1%}, {rowwise['worst_channel_lost']:.1%})")
    return out


def _arg(value) -> str:
    return json.dumps(value, separators=(",", ":")) if isinstance(value, (list, dict)) else str(value)


def train_command(cfg: ModelSettings, data: DataSettings, optim: OptimSettings, flag: str) -> str:
    """recipes/train.py with the report's model and data settings and the exclusion flag."""
    hf = getattr(cfg, "model_name_or_path", None) or getattr(cfg, "config_name", None)
    if hf:  # a transformers model: the user's own flags, not the model_args they were mapped onto
        parts = ["--model_name_or_path" if cfg.model_name_or_path else "--config_name", hf]
        parts += [*(["--tokenizer_name", cfg.tokenizer_name] if cfg.tokenizer_name else []),
                  *(["--block_size", str(data.block_size)] if data.block_size else []), "--dataset", data.dataset]
        derived = {"tokenizer", "block_size", "num_labels"}  # set from those flags (models.hf_flags.apply)
        args = {"dataset_args": {k: v for k, v in data.dataset_args.items() if k not in derived}}
    else:
        parts = ["--model", cfg.model, "--dataset", data.dataset]
        args = {"model_args": cfg.model_args, "dataset_args": data.dataset_args}
    for key, values in args.items():
        if values:
            parts += [f"--{key}", ",".join(f"{k}={_arg(v)}" for k, v in values.items())]
    if data.dataset_name:
        parts += ["--dataset_name", data.dataset_name, *(["--dataset_config", data.dataset_config]
                                                          if data.dataset_config else [])]
    if data.train_file:
        parts += ["--train_file", data.train_file]
    parts += ["--batch_size", str(optim.batch_size), *flag.split()]
    return "recipes/train.py " + " ".join(map(shlex.quote, parts))


def accelerate_config(cfg: ModelSettings, exclude: list[dict], rows: list[dict], launch: str, pad: bool) -> str:
    """A ready Accelerate config file for fp8 on torchao, in the style of accelerate_configs/fp8.yaml, with the
    launch command that carries the exclusions (Accelerate's fp8_config has no key for them)."""
    lines = [f"# fp8 (torchao, tensorwise scaling) for --model {cfg.model}, written by recipes/precision_report.py",
             f"# from {SIMULATED}.",
             "# Hardware: fp8 tensor cores (compute capability 8.9+: Ada, Hopper), torchao installed; 8 GPUs of one",
             "#           machine (another count: add --num_processes N to the launch command).",
             f"# Launch:   {launch}",
             "#",
             "# Kept out of fp8 by --fp32_modules (they compute in fp32):"]
    lines += [f"#   {e['layer']}: {'; '.join(e['reasons'])}" for e in exclude]
    left = [r["layer"] for r in rows if not r["accelerate_converts"] and r["layer"] not in {e["layer"] for e in exclude}]
    if left:
        lines.append(f"# Left in bf16 by Accelerate's own rule (in/out features not divisible by 16): {', '.join(left)}")
    lines.append("# pad_inner_dim: true (Accelerate's default) pads GEMM dimensions that do not divide by 16" +
                 (": needed here, the tokens per batch do not" if pad else ""))
    lines += ["compute_environment: LOCAL_MACHINE", "distributed_type: MULTI_GPU", "gpu_ids: all", "num_machines: 1",
              "num_processes: 8", "machine_rank: 0", "mixed_precision: fp8", "fp8_config:", "  backend: AO",
              "  pad_inner_dim: true", "main_training_function: main", "debug: false"]
    return "\n".join(lines) + "\n"


def readiness(model: torch.nn.Module, layers: dict, threshold: float = SQNR_THRESHOLD) -> dict:
    """The report's `fp8` section, from the layers `collect` filled."""
    rows = layer_rows(model, layers)
    exclude = exclusions(model, rows, threshold)
    return {"simulated": SIMULATED, "formats": list(FORMATS), "recipes": list(RECIPES),
            "judged_with": "tensorwise: weight and input E4M3, output gradient E5M2", "sqnr_threshold_db": threshold,
            "lost_threshold": LOST_THRESHOLD, "channel_lost_threshold": CHANNEL_LOST_THRESHOLD,
            "layers": rows, "exclude": exclude,
            "fp32_modules_flag": f"--fp32_modules {','.join(e['layer'] for e in exclude)}" if exclude else "",
            "pad_inner_dim": any(t % MULTIPLE for r in rows for t in r["tokens"])}


def ready_to_run(cfg, section: dict, path) -> dict:
    """The Accelerate config file (to be written to `path`) and its launch command, for the report's `fp8`
    section; nothing for a model without Linear layers."""
    if not section["layers"]:
        return {}
    command = train_command(cfg, cfg.data, cfg.optim, section["fp32_modules_flag"])
    launch = f"accelerate launch --config_file {shlex.quote(str(path))} {command}"
    return {"accelerate_config_file": str(path), "launch": launch,
            "accelerate_config": accelerate_config(cfg, section["exclude"], section["layers"], launch,
                                                   section["pad_inner_dim"])}
