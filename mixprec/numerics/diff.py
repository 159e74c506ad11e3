"""The precision diff: two precisions from the same initial weights, fed the same batches for K optimizer
steps, compared module by module against the first (the reference).

Per module that computes (Linear, convolutions, embeddings, norms, attention blocks, plus the model's output
and the loss), at every step:
- `local`: the error the module itself introduces: on the reference run's own input and weights, the
  module computed in the second precision against the reference output (a forward hook re-runs it, with
  the same random state; buffers such as batch-norm statistics are restored). This is what ranks the
  modules: an error that starts in a module shows there, not in every module after it;
- `output`: the second run's output of the module against the reference run's (upstream errors and, after
  step 1, the runs' diverging weights included);
- `grad`: the second run's gradients of the module's own parameters (unscaled) against the reference's.
Each as relative error ||y - y_ref|| / ||y_ref|| and SQNR = 10 log10(||y_ref||^2 / ||y - y_ref||^2) dB, with
a count of NaN/Inf values where the reference is finite (then the error is inf). Then the per-step loss
difference, and the weight divergence after K steps (||w - w_ref|| against how far the reference moved).

Both runs train as recipes/train.py does: the recipe's AdamW, schedule and clipping; fp16 with a real
GradScaler (a step with inf/NaN gradients is skipped and the scale halved); bf16/fp32 skip a step with
inf/NaN gradients, as the health checks do. Dropout masks are the same in both runs (same seed per step).

The gpt models tie their output layer to `wte`: `lm_head` (mixprec.models.gpt.TiedLinear) computes the logits
with `wte`'s weight, and is measured alone like any Linear; it has no weights of its own, so its weight's
gradient is part of `wte`'s grad row. The `(output)` row is the model's output (the logits) again, compared
between the runs.
"""
from __future__ import annotations

import copy
import math
import re
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..optim import adamw, scheduler
from ..training import speed
from ..health import forward_order
from ..formats import fp8, simulate
from ..formats.fp8 import sqnr_db
from ..models.gpt import TiedLinear
from ..precision import policy

if TYPE_CHECKING:
    from ..config.sections import OptimSettings, PrecisionSettings

OUTPUT, LOSS = "(output)", "(loss)"
MEASURED = (nn.Linear, nn.Bilinear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
            nn.ConvTranspose3d, nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm,
            nn.LocalResponseNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d,
            nn.InstanceNorm2d, nn.InstanceNorm3d,
            nn.MultiheadAttention, TiedLinear)


def computes(module: nn.Module) -> bool:
    return isinstance(module, MEASURED) or "Attention" in type(module).__name__


@dataclass
class Side:
    """One of the two precisions: its name, whether it is simulated, and the line that says how."""
    name: str  # no | fp16 | bf16 | fp8
    simulated: bool
    how: str

    def context(self, device_type: str):
        return simulate.computing(self.name, device_type, real=not self.simulated)


def compare(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, int]:
    """(squared error, squared reference, NaN/Inf in y where ref is finite). Two fp32 norms (torch sums in a
    cascade, accurate for any size) on the usual all-finite path; masks only when something is not finite."""
    y, ref = y.detach().float(), ref.detach().float()
    err = torch.linalg.vector_norm(y - ref).item()
    norm = torch.linalg.vector_norm(ref).item()
    if math.isfinite(err) and math.isfinite(norm):
        return err * err, norm * norm, 0
    ok_ref, ok_y = torch.isfinite(ref), torch.isfinite(y)
    bad = int((ok_ref & ~ok_y).sum())
    both = ok_ref & ok_y
    err = math.inf if bad else torch.linalg.vector_norm(y[both] - ref[both]).item() ** 2
    return err, torch.linalg.vector_norm(ref[both]).item() ** 2, bad


class Tally:
    """Errors summed over the tensors of one row at one step."""

    def __init__(self):
        self.err_sq = self.ref_sq = 0.0
        self.nonfinite = 0

    def add(self, y, ref) -> None:
        err, sq, bad = compare(y, ref)
        self.err_sq, self.ref_sq, self.nonfinite = self.err_sq + err, self.ref_sq + sq, self.nonfinite + bad

    def result(self) -> dict:
        rel = math.inf if math.isinf(self.err_sq) else math.sqrt(self.err_sq / self.ref_sq) if self.ref_sq else (
            0.0 if self.err_sq == 0 else math.inf)
        return {"rel_error": rel, "sqnr_db": sqnr_db(self.err_sq, self.ref_sq), "nonfinite": self.nonfinite}


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, (tuple, list)):
        return next((t for t in map(_first_tensor, value) if t is not None), None)
    return None


class Probe:
    """Forward hooks on both models: the reference stores its outputs and measures each module alone in the
    second precision; the second run compares its outputs with the stored ones."""

    def __init__(self, ref_model, other_model, names: list[str], other: Side, device_type: str, keep=()):
        self.other, self.device_type = other, device_type
        self.inside_fp32 = {n for n in names if any(n.startswith(k + ".") for k in keep)}  # in a kept module
        self.stored: dict[str, list] = {}
        self.local: dict[str, Tally] = {}
        self.output: dict[str, Tally] = {}
        self.calls: dict[str, int] = {}
        self.busy = False
        self.handles = []
        for name in names:
            key = OUTPUT if name == "" else name
            ref, oth = ref_model.get_submodule(name), other_model.get_submodule(name)
            if name:
                self.handles.append(ref.register_forward_pre_hook(self._pre(key), with_kwargs=True))
            self.handles.append(ref.register_forward_hook(self._ref(key, measure=bool(name)), with_kwargs=True))
            self.handles.append(oth.register_forward_hook(self._other(key), with_kwargs=True))
        self.rng: dict[str, torch.Tensor] = {}

    def new_step(self) -> None:
        self.stored, self.local, self.output, self.calls = {}, {}, {}, {}

    def _pre(self, key):
        def hook(module, args, kwargs):
            if not self.busy:
                self.rng[key] = torch.get_rng_state()
        return hook

    def _ref(self, key, measure: bool):
        def hook(module, args, kwargs, output):
            out = _first_tensor(output)
            if self.busy or out is None:
                return
            self.stored.setdefault(key, []).append(out.detach())
            if measure:
                self._measure_alone(key, module, args, kwargs, out)
        return hook

    def _measure_alone(self, key, module, args, kwargs, out) -> None:
        """The module again, in the second precision (fp32 inside a module that --fp32_modules keeps), with the
        reference call's random state, on copies of its buffers (batch-norm statistics: the reference run's own
        stay as its forward left them)."""
        buffers = {n: b.clone() for n, b in module.named_buffers()}
        context = simulate.computing(None) if key in self.inside_fp32 else self.other.context(self.device_type)
        self.busy = True
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]), context:
                torch.set_rng_state(self.rng[key])
                alone = _first_tensor(torch.func.functional_call(module, buffers, args, kwargs))
        finally:
            self.busy = False
        self.local.setdefault(key, Tally()).add(alone.float(), out.float())

    def _other(self, key):
        def hook(module, args, kwargs, output):
            out = _first_tensor(output)
            if out is None or key not in self.stored:
                return
            i = self.calls.get(key, 0)
            self.calls[key] = i + 1
            if i < len(self.stored[key]):
                self.output.setdefault(key, Tally()).add(out.float(), self.stored[key][i].float())
                self.stored[key][i] = None  # compared: free it
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class Trainer:
    """One run's optimizer step, as recipes/train.py takes it."""

    def __init__(self, model, side: Side, optim: OptimSettings, precision: PrecisionSettings, device, steps: int):
        self.model, self.side = model, side
        self.optimizer = adamw(model, optim.lr, optim.weight_decay, fused=speed.fused_adamw(device))  # as train.py
        self.scheduler = scheduler(self.optimizer, optim.warmup_steps, optim.max_steps or steps, optim.lr_schedule,
                                   optim.min_lr_ratio)
        self.scaler = torch.amp.GradScaler(device.type, init_scale=precision.init_scale,
                                           growth_interval=precision.growth_interval) if side.name == "fp16" else None
        self.max_norm = optim.max_grad_norm or math.inf

    def backward(self, loss) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)

    def step(self) -> dict:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        finite = bool(torch.isfinite(norm))
        if self.scaler:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            out = {"skipped": not finite, "loss_scale": scale}
        else:
            if finite:
                self.optimizer.step()
            out = {"skipped": not finite}
        with warnings.catch_warnings():  # a skipped first step: the schedule still moves on, as in train.py
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step()
        return {**out, "grad_norm": norm.item()}


def install_fp8(model: nn.Module, keep: list[str], recipe: str) -> dict[str, str | None]:
    """Give the Linear layers that fp8 would convert a forward that runs fp8 whenever fp8 is simulated."""
    layers = fp8.converted_linears(model, keep)
    for name, reason in layers.items():
        if reason is None:
            model.get_submodule(name).forward = Fp8Forward(model.get_submodule(name), recipe)
    return layers


class Fp8Forward:
    def __init__(self, module: nn.Linear, recipe: str):
        self.module, self.recipe = module, recipe

    def __call__(self, x):
        m = self.module
        if simulate.current() != "fp8":
            return type(m).forward(m, x)
        with simulate.paused():
            return fp8.fp8_linear(x, m.weight, m.bias, self.recipe)


def _grad_rows(ref_model, oth_model, names) -> dict[str, dict]:
    rows = {}
    for name in names:
        tally, ref_mod, oth_mod = Tally(), ref_model.get_submodule(name), oth_model.get_submodule(name)
        for (_, p), (_, q) in zip(ref_mod.named_parameters(recurse=False), oth_mod.named_parameters(recurse=False)):
            if p.grad is not None and q.grad is not None:
                tally.add(q.grad, p.grad)
        if tally.ref_sq or tally.nonfinite or tally.err_sq:
            rows[name] = tally.result()
    return rows


def run(optim: OptimSettings, precision: PrecisionSettings, model: nn.Module, batches: list[dict], loss_fn,
        device: torch.device, sides: tuple[Side, Side], keep: list[str], fp8_recipe: str = "tensorwise",
        progress=None) -> dict:
    """The diff of `sides[1]` against `sides[0]` on `model` (left untouched). Returns the result dict that
    `mixprec.numerics.render` writes."""
    started = time.perf_counter()
    ref_side, oth_side = sides
    models = [copy.deepcopy(model).to(device).train() for _ in sides]  # the same initial weights
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    fp8_layers = {}
    for m in models:
        policy.keep_fp32(m, keep)
        if "fp8" in (ref_side.name, oth_side.name):
            fp8_layers = install_fp8(m, keep, fp8_recipe)
    order = forward_order(models[0], {"inputs": batches[0]["inputs"]})
    names = [n for n in order if computes(models[0].get_submodule(n))]
    ends = finish_order(models[0], batches[0]["inputs"], names)
    probe = Probe(models[0], models[1], names + [""], oth_side, device.type, keep)
    trainers = [Trainer(m, s, optim, precision, device, len(batches)) for m, s in zip(models, sides)]
    steps, per_step = [], []
    try:
        for k, batch in enumerate(batches):
            probe.new_step()
            losses = []
            for i, (m, side, trainer) in enumerate(zip(models, sides, trainers)):
                torch.manual_seed(optim.seed + k)
                with side.context(device.type):
                    logits = m(batch["inputs"])
                    loss = loss_fn(logits, batch["labels"])
                if i == 0:
                    loss_local = Tally()
                    with torch.no_grad(), oth_side.context(device.type):
                        loss_local.add(loss_fn(logits.detach(), batch["labels"]), loss.detach())
                trainer.backward(loss)
                losses.append(loss.detach())
            loss_out = Tally()
            loss_out.add(losses[1], losses[0])
            rows = {key: {"local": t.result()} for key, t in probe.local.items()}
            for key, t in probe.output.items():
                rows.setdefault(key, {})["output"] = t.result()
            for key, g in _grad_rows(models[0], models[1], names).items():
                rows.setdefault(key, {})["grad"] = g
            rows[LOSS] = {"local": loss_local.result(), "output": loss_out.result()}
            ref_step, oth_step = (t.step() for t in trainers)
            a, b = (v.item() for v in losses)
            steps.append({"step": k + 1, "loss": {ref_side.name: a, oth_side.name: b}, "loss_diff": b - a,
                          "loss_rel_diff": abs(b - a) / abs(a) if a and math.isfinite(b - a) else math.inf,
                          ref_side.name: ref_step, oth_side.name: oth_step})
            per_step.append(rows)
            if progress:
                progress(k + 1, a, b)
    finally:
        probe.remove()
    types = {n: type(models[0].get_submodule(n)).__name__ for n in names}
    types.update({OUTPUT: "model output (logits)", LOSS: "loss_fn (fp32)"})
    return {"modules": _module_rows([*names, OUTPUT, LOSS], types, per_step, [*ends, OUTPUT, LOSS]), "steps": steps,
            "weights": divergence(models[0], models[1], initial, names),
            "fp8_layers": fp8_layers, "wall_time_s": time.perf_counter() - started}


def finish_order(model: nn.Module, inputs: torch.Tensor, names: list[str]) -> list[str]:
    """`names` in the order their forward passes end (one sample, no gradients): a module ends after the modules
    it calls, so an error that starts inside an attention block ranks its layer before the block."""
    seen: list[str] = []
    hooks = [model.get_submodule(n).register_forward_hook(lambda m, a, o, name=n: seen.append(name)) for n in names]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(inputs[:1])
    finally:
        for hook in hooks:
            hook.remove()
    return [n for n in dict.fromkeys(seen) if n in names]


def _module_rows(names, types, per_step, ends) -> list[dict]:
    """One row per module in forward order, each with its per-step errors, and the rank (1 = worst; ties, NaN/Inf
    above all, go to the module whose forward ends first: the innermost, the earliest)."""
    end = {name: i for i, name in enumerate(ends)}
    rows = []
    for i, name in enumerate(names):
        row = {"module": name, "type": types[name], "forward_index": i,
               **{kind: [step.get(name, {}).get(kind) for step in per_step] for kind in ("local", "output", "grad")}}
        local = [x["sqnr_db"] for x in row["local"] if x]
        row["worst_local_sqnr_db"] = min(local) if local else None
        rows.append(row)
    ranked = sorted(rows, key=lambda r: (r["worst_local_sqnr_db"] is None, r["worst_local_sqnr_db"] or 0,
                                         end.get(r["module"], len(end)), r["forward_index"]))
    for rank, row in enumerate(ranked, 1):
        row["rank"] = rank
    return rows


def divergence(ref_model, oth_model, initial: dict, names: list[str]) -> dict:
    """||w - w_ref|| / ||w_ref|| per module and in all, and against how far the reference moved from the start."""
    ref_params = dict(ref_model.named_parameters())
    oth_params = dict(oth_model.named_parameters())

    def measure(params: list[str]) -> dict:
        diff = sum((oth_params[n].detach() - ref_params[n].detach()).double().pow(2).sum().item() for n in params)
        norm = sum(ref_params[n].detach().double().pow(2).sum().item() for n in params)
        moved = sum((ref_params[n].detach() - initial[n]).double().pow(2).sum().item() for n in params)
        return {"rel_divergence": math.sqrt(diff / norm) if norm else 0.0,
                "divergence_over_update": math.sqrt(diff / moved) if moved else (0.0 if diff == 0 else math.inf)}

    per_module = {}
    for name in names:
        own = [f"{name}.{n}" if name else n for n, _ in ref_model.get_submodule(name).named_parameters(recurse=False)]
        own = [n for n in own if n in ref_params]  # a tied weight (a transformers lm_head) counts where it is first
        if own:
            per_module[name] = measure(own)
    return {"total": measure(list(ref_params)), "per_module": per_module}
