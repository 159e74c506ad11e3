"""`--fp32_modules auto` under fp16, during training: a forward overflow that a skipped step shows moves the module
that owns it to fp32 before the next step, instead of the GradScaler lowering its scale again and again.

The plan measured at start (mixprec.precision.auto_fp32) sees the first NUM_BATCHES batches only; an activation
that grows later in training, or a token that appears only in later batches, can still overflow fp16. The health
checks (mixprec.health.monitor) call a `Mover` after a step whose gradient norm is inf/NaN (the GradScaler skips
it; the norm is read from the all-reduced gradients, so every process calls it on the same steps), and nothing
is computed on any other step. The Mover (`find`) runs the step's micro-batches again through the model as it
now trains (fp16 autocast, the plan's modules in fp32; no gradients, the random state and buffers left as they
were), with a hook on every module. A module whose output is NaN/Inf while its inputs are finite is recomputed
alone, with autocast off and its inputs in fp32: where that is finite, the overflow is fp16's, not the model's,
and the innermost such module (a leaf, or a block whose own arithmetic overflows) is kept in fp32
(policy.keep_fp32); again, until the output is finite or no module qualifies (at most ROUNDS times). A step
skipped because the loss scale was too high for the gradients (ordinary back-off) shows no such module: nothing
moves. Several processes gather what each found and all keep the union: one plan everywhere.

The move is an event in metrics.jsonl (`fp32_module_moved`: the module, why, the new plan) and one console line;
the plan (prec.fp32_plan, config.yaml's effective.fp32_plan with `moved`, and the settings each later checkpoint
records) gains the module, so that a resume keeps it in fp32.
"""
from __future__ import annotations

import torch

from ..health.event import Event
from .auto_fp32 import ROUNDS, _MatmulFlops, _finite, _floats

FP16_MAX = torch.finfo(torch.float16).max


def _fp32(value):
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, (list, tuple)):
        return type(value)(_fp32(v) for v in value)
    if isinstance(value, dict):
        return {k: _fp32(v) for k, v in value.items()}
    return value


def _largest(tensors) -> float:
    return max([t.detach().abs().max().item() for t in tensors if t.numel()] or [0.0])


def overflowing(model: torch.nn.Module, batches: list[dict], device_type: str, flops=None) -> dict[str, dict]:
    """The innermost modules whose output under fp16 autocast is NaN/Inf from finite inputs and finite when the
    module alone is recomputed in fp32: {name: {'max_abs': largest fp32 output, 'input_max_abs': largest input}}."""
    bad: dict[str, dict] = {}
    busy = [False]

    def hook(name):
        def fn(module, args, kwargs, output):
            if busy[0] or _finite(_floats(output)) or not _finite(_floats((args, kwargs))) or \
                    any(o.startswith(name + ".") for o in bad):  # inner modules' hooks run first: one inside is
                return  # the owner
            busy[0] = True
            try:
                with torch.autocast(device_type, enabled=False):
                    ref = _floats(type(module).forward(module, *_fp32(args), **_fp32(kwargs)))
            finally:
                busy[0] = False
            if ref and _finite(ref):  # NaN/Inf in fp32 too: the model's values, not fp16's range
                row = bad.setdefault(name, {"max_abs": 0.0, "input_max_abs": 0.0})
                row["max_abs"] = max(row["max_abs"], _largest(ref))
                row["input_max_abs"] = max(row["input_max_abs"], _largest(_floats((args, kwargs))))
        return fn

    handles = [m.register_forward_hook(hook(n), with_kwargs=True) for n, m in model.named_modules() if n]
    try:
        with torch.autocast(device_type, dtype=torch.float16):
            for batch in batches:
                if flops is not None:
                    with flops:
                        model(batch["inputs"])
                else:
                    model(batch["inputs"])
    finally:
        for h in handles:
            h.remove()
    return {n: row for n, row in bad.items() if not any(o.startswith(n + ".") for o in bad)}


def reason(row: dict, step: int) -> str:
    if row["max_abs"] > FP16_MAX:
        return f"its output reached {row['max_abs']:.3g} > {FP16_MAX:g} (fp16's largest) at step {step}"
    if row["input_max_abs"] > FP16_MAX:
        return f"its input reached {row['input_max_abs']:.3g} > {FP16_MAX:g}, which fp16 autocast casts to inf, " \
               f"at step {step}"
    return f"NaN/Inf under fp16 autocast from finite inputs, finite in fp32, at step {step}"


def find(model: torch.nn.Module, batches: list[dict], device_type: str, keep_fp32, step: int) -> dict:
    """The modules to move (see the module docstring), kept in fp32 on `model` as they are found: {name: {'reason',
    'max_abs'}}, and the forward's matmul FLOP share left in fp16 after them (None when nothing moved)."""
    found: dict[str, dict] = {}
    share = None
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    devices = [torch.cuda.current_device()] if device_type == "cuda" else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for _ in range(ROUNDS):
                flops = _MatmulFlops() if found else None  # the share with the moves: not on an ordinary back-off
                new = {n: row for n, row in overflowing(model, batches, device_type, flops).items() if n not in found}
                if flops is not None:
                    total = sum(flops.by_dtype.values())
                    share = round(flops.by_dtype.get("float16", 0) / total, 4) if total else None
                if not new:
                    break
                keep_fp32(model, list(new))
                found.update({n: {"reason": reason(row, step), "max_abs": row["max_abs"]} for n, row in new.items()})
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
    return {"moves": found, "matmul_flops_share": share}


class Mover:
    """Called by the health checks after a step the GradScaler skipped (mixprec.health.monitor): moves what
    `find` names on every process, updates the plan, and returns the event (None when nothing moved)."""

    def __init__(self, plan: dict, settings: dict, accelerator, keep_fp32, on_move=None):
        self.plan, self.settings, self.acc, self.keep_fp32 = plan, settings, accelerator, keep_fp32
        self.on_move = on_move  # called with the updated plan (config.yaml's record)

    def __call__(self, model: torch.nn.Module, batches: list[dict], step: int) -> Event | None:
        found = find(model, batches, self.acc.device.type, self.keep_fp32, step) if batches else \
            {"moves": {}, "matmul_flops_share": None}
        everywhere = [found]
        if self.acc.num_processes > 1:
            from accelerate.utils import gather_object

            everywhere = gather_object([found])
        moves: dict[str, dict] = {}
        for each in everywhere:  # the union, in process order: the same on every process
            moves.update({n: r for n, r in each["moves"].items() if n not in moves})
        if not moves:
            return None
        self.keep_fp32(model, list(moves))  # what another process found
        shares = [e["matmul_flops_share"] for e in everywhere if e["matmul_flops_share"] is not None]
        self._record(moves, step, shares[0] if len(everywhere) == 1 and shares else None)
        names = [m["name"] for m in self.plan["modules"]]
        said = "; ".join(f"{n} ({m['reason']})" for n, m in moves.items())
        text = (f"fp16 forward overflow in {said}: the module alone is finite in fp32, so no loss scale fixes it. "
                f"Moved to fp32 from step {step + 1} on (--fp32_modules auto), instead of skipping steps and lowering "
                f"the loss scale; the fp32 plan is now {', '.join(names)}")
        return Event(step, "fp32_module_moved", max(m["max_abs"] for m in moves.values()), FP16_MAX, text + ".", list(moves),
                     "fp16_forward_overflow", "none: moved to fp32 (--fp32_modules auto)",
                     extra={"fp32_plan": names})

    def _record(self, moves: dict[str, dict], step: int, share: float | None) -> None:
        plan = self.plan
        plan["modules"] = [*plan["modules"], *({"name": n, "reason": f"moved at step {step}: overflow: {m['reason']}"}
                                               for n, m in moves.items())]
        plan["moved"] = [*plan.get("moved", []), *({"step": step, "name": n, "reason": m["reason"]}
                                                   for n, m in moves.items())]
        plan["matmul_flops_share"] = share  # measured on this step's batches with the moved plan (one process)
        self.settings["fp32_plan"] = {k: v for k, v in plan.items() if k != "source"}  # each later checkpoint's
        if self.on_move is not None:
            self.on_move(plan)
