"""What a bad step's batch and model show, looked at on event steps only (no work, no device read otherwise).

`inspect(model, batches, fp16)` runs the step's micro-batches once more through the model in fp32, without
gradients (batch-norm statistics, the random state and the training mode are left as they were), with a hook on
every leaf module, and returns:

- `nonfinite_inputs`: the NaN/inf values in the batch's inputs, and the rows holding them (a data problem: no
  learning rate or precision fixes it);
- `input_rms`: the root mean square of the float inputs (features far from unit scale);
- `outlier_rows`: rows whose inputs' root mean square is over OUTLIER_FACTOR times the batch's median row's
  (one bad row, not a scale all rows share), with that factor (`outlier_factor`);
- `overflow`: in fp16, the modules whose fp32 input or output exceeds 65504 (under fp16 autocast they become
  inf): the modules to keep in fp32, as --fp32_modules takes them;
- `gain`: the weight layer (Linear, convolution) whose output is largest against its input, and by how much
  (a layer initialised to explode).
"""
from __future__ import annotations

import math

import torch

FP16_MAX = torch.finfo(torch.float16).max
INPUT_RMS_LIMIT = 100.0  # float inputs whose RMS exceeds this are far from the unit scale layers are built for
OUTLIER_FACTOR = 20.0  # a row whose input RMS is this many times the batch's median row's is an outlier
OUTLIER_MIN_ROWS = 4  # rows a batch needs before one of them can stand out
GAIN_LIMIT = 10.0  # a weight layer whose output RMS is this many times its input's is initialised to explode


def _rms(value) -> float | None:
    if not torch.is_tensor(value) or not value.is_floating_point() or value.numel() == 0:
        return None
    value = value.detach().float()
    finite = value[torch.isfinite(value)]
    return float(finite.pow(2).mean().sqrt()) if finite.numel() else math.inf


def _largest(value) -> float:
    if not torch.is_tensor(value) or not value.is_floating_point() or value.numel() == 0:
        return 0.0
    return float(value.detach().float().abs().nan_to_num(posinf=math.inf).max())


def _weight_layer(module) -> bool:
    weight = getattr(module, "weight", None)
    return torch.is_tensor(weight) and weight.dim() >= 2 and not isinstance(module, torch.nn.Embedding)


def inspect(model: torch.nn.Module, batches: list[dict], fp16: bool) -> dict:
    out = {"nonfinite_inputs": 0, "nonfinite_rows": [], "input_rms": None, "outlier_rows": [], "outlier_factor": None,
           "overflow": [], "gain": None}
    inputs = [b["inputs"] for b in batches if torch.is_tensor(b.get("inputs"))]
    floats = [x for x in inputs if x.is_floating_point()]
    for x in floats:
        bad = ~torch.isfinite(x.reshape(len(x), -1))
        out["nonfinite_inputs"] += int(bad.sum())
        out["nonfinite_rows"] += bad.any(dim=1).nonzero().flatten().tolist()
    if out["nonfinite_inputs"]:
        return out
    if floats:
        out["input_rms"] = max(_rms(x) for x in floats)
        _outliers(floats, out)
    seen: dict[str, tuple[float, float, float | None, float | None]] = {}
    order: list[str] = []

    def hook(name):
        def record(module, args, output):
            first = args[0] if args else None
            old = seen.get(name, (0.0, 0.0, None, None))
            rin, rout = _rms(first), _rms(output if torch.is_tensor(output) else None)
            seen[name] = (max(old[0], _largest(first)), max(old[1], _largest(output)),
                          rin if old[2] is None else max(old[2], rin or 0), rout if old[3] is None else
                          max(old[3], rout or 0))
            if name not in order:
                order.append(name)
        return record

    leaves = [(n, m) for n, m in model.named_modules() if n and not list(m.children())]
    hooks = [m.register_forward_hook(hook(n)) for n, m in leaves]
    modes = {m: m.training for m in model.modules()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), torch.autocast(
                next(model.parameters()).device.type, enabled=False):
            model.eval()
            for x in inputs:
                model(x)
    finally:
        for m, mode in modes.items():
            m.training = mode
        for h in hooks:
            h.remove()
    kinds = dict(leaves)
    if fp16:
        out["overflow"] = [n for n in order if _weight_layer(kinds[n]) and max(seen[n][:2]) > FP16_MAX]
    gains = [(seen[n][3] / seen[n][2], n) for n in order if _weight_layer(kinds[n]) and seen[n][2] and seen[n][3]]
    if gains:
        gain, name = max(gains)
        out["gain"] = (name, gain)
    return out


def _outliers(floats: list[torch.Tensor], out: dict) -> None:
    """The rows (counted across the step's micro-batches) whose inputs stand out from the batch's median row."""
    rows = torch.cat([x.detach().float().reshape(len(x), -1).pow(2).mean(dim=1).sqrt() for x in floats])
    if len(rows) < OUTLIER_MIN_ROWS:
        return
    median = float(rows.median())
    if median > 0:
        factors = rows / median
        out["outlier_rows"] = (factors > OUTLIER_FACTOR).nonzero().flatten().tolist()
        out["outlier_factor"] = float(factors.max()) if out["outlier_rows"] else None


def unscaled_fp16(model: torch.nn.Module, batches: list[dict], order: dict[str, int]) -> dict:
    """The step's backward once more under fp16 autocast at loss scale 1 (no GradScaler), its gradients taken
    apart from the parameters' own: `modules` whose gradients overflow even unscaled (where it starts: the
    latest in the forward pass last), and `largest` |gradient| when none does (the scale that would fit)."""
    from ..evaluation import loss_fn

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    bad, largest = set(), 0.0
    modes = {m: m.training for m in model.modules()}
    try:
        with torch.random.fork_rng(devices=[]):
            model.eval()
            for batch in batches:
                with torch.autocast(named[0][1].device.type, dtype=torch.float16):
                    loss = loss_fn(model(batch["inputs"]), batch["labels"])
                grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
                for (name, _), g in zip(named, grads):
                    if g is None:
                        continue
                    if not bool(torch.isfinite(g).all()):
                        bad.add(name.rpartition(".")[0] or name)
                    else:
                        largest = max(largest, float(g.abs().max()))
    finally:
        for m, mode in modes.items():
            m.training = mode
    return {"modules": sorted(bad, key=lambda n: order.get(n, len(order))), "largest": largest}
