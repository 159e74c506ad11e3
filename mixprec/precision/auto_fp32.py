"""`--fp32_modules auto`: the modules to keep in fp32, chosen by measuring the run's own model on its own first
training batches, before the run folder is touched (mixprec.precision.policy.apply calls `resolve`).

The measurement (`choose`), on NUM_BATCHES batches of --batch_size, forward passes only, the training random
state left as it was, buffers (batch-norm statistics) restored:

1. the fp32 forward pass; a hook on every leaf module recomputes it alone under the training precision's
   autocast, on the fp32 pass's own inputs (the same random state: the same dropout mask), and compares:
   - overflow: NaN/Inf in the autocast output where the fp32 output is finite: an output above the format's
     largest value (fp16: 65504), an input above it that autocast casts to inf, or NaN/Inf from finite inputs;
   - error: the relative error of the output, ||y_autocast - y_fp32|| / ||y_fp32|| over all the batches' values,
     above ERROR_THRESHOLD (2%). What a module does to its own input, so an error is charged where it starts,
     not to every module after it. Rounding alone gives 0.03-0.04% under fp16 (10-bit mantissa) and
     0.24-0.29% under bf16 (7 bits) on the lesson's MLP, gpt_tiny and a tiny transformers Llama; 2% is 50 and
     7 times that, so what passes it is not rounding but values lost: fp16's subnormals (below 6.1e-5) or
     cancellation.
   The flagged leaves are the first plan.
2. the batches again under autocast with the plan's modules in fp32 (policy.keep_fp32, as training runs
   them), hooks on every module: one whose output is NaN/Inf while its inputs are finite, with no module
   inside it doing so, joins the plan (a module after a kept one may receive its fp32 output above 65504, or
   a block's own arithmetic, an elementwise product, may overflow); repeated until the model's output is
   finite (at most ROUNDS times), else a UsageError: fp16 cannot train this model with modules in fp32.
   The last pass counts the matmul FLOPs of the forward by the dtype they run in: the share left in the
   training precision is said with the plan.

Under DDP the main process measures and the plan is broadcast: every process keeps the same modules. A resume
reuses the plan its checkpoint recorded (`recorded`), and measures nothing. Under fp32 nothing is measured.
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..errors import UsageError

if TYPE_CHECKING:
    from ..config.sections import OptimSettings

ERROR_THRESHOLD = 0.02  # relative error of a module's output under autocast against fp32 (see the docstring)
NUM_BATCHES = 4
ROUNDS = 8
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _floats(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _floats(v)]
    if isinstance(value, dict):  # transformers' ModelOutput is a dict
        return [t for v in value.values() for t in _floats(v)]
    return []


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


class _Alone:
    """Pass 1: forward hooks on the leaves of the fp32 pass; each leaf recomputed alone under autocast."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, device_type: str):
        self.dtype, self.device_type = dtype, device_type
        self.rows: dict[str, dict] = {}
        self.rng: dict[str, torch.Tensor] = {}
        self.busy = False
        leaves = [(n, m) for n, m in model.named_modules() if n and not list(m.children())]
        self.handles = [h for n, m in leaves for h in (
            m.register_forward_pre_hook(self._pre(n), with_kwargs=True),
            m.register_forward_hook(self._post(n), with_kwargs=True))]

    def _pre(self, name):
        def hook(module, args, kwargs):
            if not self.busy:
                self.rng[name] = torch.get_rng_state()
        return hook

    def _post(self, name):
        def hook(module, args, kwargs, output):
            ref = _floats(output)
            if self.busy or not ref or not _finite(ref):
                return
            buffers = {n: b.clone() for n, b in module.named_buffers()}
            self.busy = True
            try:
                with torch.no_grad(), torch.random.fork_rng(devices=[]), \
                        torch.autocast(self.device_type, dtype=self.dtype):
                    torch.set_rng_state(self.rng[name])
                    alone = _floats(torch.func.functional_call(module, buffers, args, kwargs))
            finally:
                self.busy = False
            row = self.rows.setdefault(name, {"err_sq": 0.0, "ref_sq": 0.0, "nonfinite": 0, "max_abs": 0.0,
                                              "input_max_abs": 0.0, "weight_max_abs": max(
                                                  [p.detach().abs().max().item() for p in
                                                   module.parameters(recurse=False) if p.numel()] or [0.0])})
            inputs = _floats((args, kwargs))
            row["input_max_abs"] = max([row["input_max_abs"], *(t.abs().max().item() for t in inputs if t.numel())])
            for y, r in zip(alone, ref):
                y, r = y.detach().float(), r.detach().float()
                ok = torch.isfinite(y)
                row["nonfinite"] += int((~ok).sum())
                row["err_sq"] += (y - r)[ok].double().pow(2).sum().item()
                row["ref_sq"] += r.double().pow(2).sum().item()
                row["max_abs"] = max(row["max_abs"], r.abs().max().item() if r.numel() else 0.0)
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def _reason(row: dict, fmt: str) -> str | None:
    top = torch.finfo(DTYPES[fmt]).max
    if row["nonfinite"]:
        if row["max_abs"] > top:
            return f"overflow: its fp32 output reaches {row['max_abs']:.3g}, above {fmt}'s {top:.6g}"
        if row["input_max_abs"] > top:
            return f"overflow: its input reaches {row['input_max_abs']:.3g}, which {fmt} autocast casts to inf"
        if row["weight_max_abs"] > top:
            return f"overflow: its weights reach {row['weight_max_abs']:.3g}, which {fmt} autocast casts to inf"
        return f"overflow: NaN/Inf under {fmt} autocast from finite inputs"
    rel = math.sqrt(row["err_sq"] / row["ref_sq"]) if row["ref_sq"] else 0.0
    if rel > ERROR_THRESHOLD:
        return f"error: relative error {rel:.2%} under {fmt} autocast, above {ERROR_THRESHOLD:.0%}"
    return None


class _MatmulFlops(TorchDispatchMode):
    """Matmul FLOPs (torch's flop formulas: mm, addmm, bmm, convolution, attention) by the dtype they run in."""

    def __init__(self):
        super().__init__()
        self.by_dtype: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            dtype = str(_floats(out)[0].dtype).replace("torch.", "") if _floats(out) else "other"
            self.by_dtype[dtype] = self.by_dtype.get(dtype, 0) + int(formula(*args, **(kwargs or {}), out_val=out))
        return out


def _check(model, names: list[str], batches: list[dict], dtype, device_type: str, keep_fp32,
           flops=None) -> tuple[bool, list]:
    """Pass 2: the batches under autocast with `names` in fp32 (`keep_fp32`: mixprec.precision.policy's). (output
    finite, [modules whose output is NaN/Inf from finite inputs with no module inside them doing so])."""
    bad: dict[str, bool] = {}

    def hook(name):
        def fn(module, args, kwargs, output):
            if not _finite(_floats(output)) and _finite(_floats((args, kwargs))):
                bad[name] = True
        return fn

    mods = [(n, m) for n, m in model.named_modules() if n]
    handles = [m.register_forward_hook(hook(n), with_kwargs=True) for n, m in mods]
    kept = [model.get_submodule(n) for n in names if "forward" not in model.get_submodule(n).__dict__]
    keep_fp32(model, names)
    finite = True
    try:
        with torch.no_grad(), torch.autocast(device_type, dtype=dtype):
            for i, batch in enumerate(batches):
                torch.manual_seed(i)
                if flops is not None:
                    with flops:
                        out = model(batch["inputs"])
                else:
                    out = model(batch["inputs"])
                finite &= _finite(_floats(out))
    finally:
        for h in handles:
            h.remove()
        for module in kept:
            del module.forward  # back to the class's forward
    innermost = [n for n in bad if not any(o.startswith(n + ".") for o in bad)]
    return finite, innermost


def _without_inner(names: list[str]) -> list[str]:
    return [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]


def choose(model: torch.nn.Module, batches: list[dict], fmt: str, device: torch.device, keep_fp32) -> dict:
    """The plan for `fmt` ('fp16' or 'bf16'), measured on `batches` (see the module docstring); `keep_fp32`:
    how training keeps modules in fp32 (mixprec.precision.policy.keep_fp32)."""
    dtype, started = DTYPES[fmt], time.perf_counter()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    was_training = model.training
    model.train()
    try:
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
            alone = _Alone(model, dtype, device.type)
            try:
                with torch.no_grad(), torch.autocast(device.type, enabled=False):
                    for i, batch in enumerate(batches):
                        torch.manual_seed(i)
                        model(batch["inputs"])
            finally:
                alone.remove()
            reasons = {n: r for n, row in alone.rows.items() if (r := _reason(row, fmt))}
            flops = _MatmulFlops()
            for _ in range(ROUNDS):
                finite, new = _check(model, list(reasons), batches, dtype, device.type, keep_fp32, flops)
                if finite and not new:
                    break
                if not new:
                    raise UsageError(f"--fp32_modules auto: {fmt} autocast gives NaN/Inf even with "
                                     f"{', '.join(reasons) or 'no module'} in fp32: train in bf16 or fp32")
                reasons.update({n: f"overflow: NaN/Inf under {fmt} autocast from finite inputs, with the modules "
                                   f"before it in fp32" for n in new})
                reasons = {n: reasons[n] for n in _without_inner(list(reasons))}
                flops = _MatmulFlops()
            else:
                raise UsageError(f"--fp32_modules auto: {fmt} autocast still gives NaN/Inf after {ROUNDS} rounds "
                                 f"of keeping modules in fp32: train in bf16 or fp32")
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
        model.train(was_training)
    worst = max(alone.rows.items(), key=lambda kv: kv[1]["err_sq"] / kv[1]["ref_sq"] if kv[1]["ref_sq"] else 0,
                default=(None, None))
    total = sum(flops.by_dtype.values())
    return {"precision": fmt, "modules": [{"name": n, "reason": r} for n, r in reasons.items()],
            "error_threshold": ERROR_THRESHOLD, "batches": len(batches),
            "batch_size": len(batches[0]["inputs"]) if batches else 0,
            "seconds": round(time.perf_counter() - started, 3),
            "worst_error": ({"name": worst[0], "relative_error": math.sqrt(worst[1]["err_sq"] / worst[1]["ref_sq"])}
                            if worst[0] is not None and worst[1]["ref_sq"] else None),
            "matmul_flops_share": (round(flops.by_dtype.get(str(dtype).replace("torch.", ""), 0) / total, 4)
                                   if total else None)}


def resolve(optim: OptimSettings, model: torch.nn.Module, accelerator, effective: str, bundle, keep_fp32, state=None) -> dict:
    """The plan for this run: the one its checkpoint recorded (a resume: nothing measured), none under fp32, else
    measured on the main process's first NUM_BATCHES training batches and broadcast to the others."""
    recorded = state.settings.get("fp32_plan") if state is not None else None
    if isinstance(recorded, dict):
        names = {n for n, _ in model.named_modules()}
        missing = [m["name"] for m in recorded.get("modules", []) if m["name"] not in names]
        if missing:
            raise UsageError(f"resume: the checkpoint's --fp32_modules auto plan names {', '.join(missing)}, which "
                             f"this model does not have: start a new --output_dir")
        return {**recorded, "source": f"recorded by the checkpoint of step {state.step}, not measured again"}
    if effective not in DTYPES:
        return {"precision": effective, "modules": [], "batches": 0, "seconds": 0.0,
                "source": "nothing measured: training is fp32"}
    result = [None]
    if accelerator.is_main_process:
        from ..run_folder.run_loading import batches

        device = next(model.parameters()).device  # where the model is built (accelerate.prepare moves it later)
        try:
            found = batches(bundle, optim, NUM_BATCHES, device)
            result = [{"plan": choose(model, found, effective, device, keep_fp32)}]
        except UsageError as err:
            result = [{"error": str(err)}]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(result)
    if "error" in result[0]:
        raise UsageError(result[0]["error"])
    where = (f" on process 0 and broadcast: {accelerator.num_processes} processes, one plan"
             if accelerator.num_processes > 1 else "")
    return {**result[0]["plan"], "source": f"measured{where}"}


def describe(plan: dict) -> str:
    """The banner's line after `fp32 modules   `."""
    fmt, mods = plan["precision"], plan["modules"]
    if plan.get("batches", 0) == 0 and not mods and "recorded" not in plan["source"]:
        return "auto: none (training is fp32: nothing to keep, nothing measured)"
    cost = (f"{plan['batches']} batches of {plan['batch_size']}, {plan['seconds']:.2f} s, error threshold "
            f"{plan['error_threshold']:.0%}; {plan['source']}")
    if not mods:
        worst = plan.get("worst_error")
        return (f"auto: none needed under {fmt} (no overflow, every module's relative error under "
                f"{plan['error_threshold']:.0%}" + (f"; the largest {worst['relative_error']:.2%} in {worst['name']}"
                                                    if worst else "") + f"; {cost})")
    share = plan.get("matmul_flops_share")
    listed = "; ".join(f"{m['name']} ({m['reason']})" for m in mods)
    return (f"auto: {listed}" + (f"; {share:.1%} of the forward's matmul FLOPs stay in {fmt}" if share else "")
            + f" ({cost})")
