"""Where the master weights live: `--master_weights fp32|bf16` and, with bf16, `--bf16_update round|kahan|stochastic`.

- fp32 (default): the model's weights are fp32, the forward runs under autocast, torch's AdamW updates the fp32
  weights with fp32 states (4 + 4 + 8 = 16 bytes per parameter: weight, gradient, two Adam states).
- bf16: the model's weights themselves are bf16 (`model.to(bfloat16)` before `accelerator.prepare`; there is no
  fp32 copy anywhere), the gradients are bf16, and `BF16AdamW` keeps Adam's two states in bf16 too. Each step
  upcasts the weight, gradient and states to fp32, computes AdamW's update there, and stores the result in bf16:
  - `round`: round to nearest. An update smaller than half a bf16 step at the weight's magnitude (2**-8 of it)
    rounds back to the old weight: lost. Allowed for demonstration; the banner warns about it (8 bytes/param).
  - `kahan`: a bf16 compensation buffer per parameter keeps what rounding dropped and adds it to the next update
    (Kahan summation): weight + compensation tracks the exact sum (10 bytes/param).
  - `stochastic`: the fp32 result is rounded up or down at random with the probability that makes the rounding
    unbiased, the random bits drawn from the optimizer's own `torch.Generator`, seeded by --seed and the same on
    every process (the replicas of DDP stay equal), whose state is in the optimizer's state_dict (8 bytes/param).
  Adam's states are rounded to bf16 after each update like the weight: to nearest in `round` and `kahan`, at
  random in `stochastic`.
Everything a mode needs to resume bitwise (compensation buffers, the generator's state) is in the optimizer's
state_dict, which `accelerator.save_state` checkpoints. torchao's `_AdamW(bf16_stochastic_round=True)` was checked
(torchao 0.18.0 installs and runs on this CPU) and not used: it torch.compiles its step (16 s for the first step
of one parameter shape on the 2-core CPU), has no Kahan summation, and draws from the global random generator.
"""
from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch

from ..errors import UsageError

if TYPE_CHECKING:
    from ..config.sections import OptimSettings, PrecisionSettings

BF16_UPDATES = ("round", "kahan", "stochastic")
_WHAT = {"round": "rounded to nearest bf16 (updates below half a bf16 step are lost)",
         "kahan": "Kahan-compensated (a bf16 compensation buffer per parameter)",
         "stochastic": "stochastically rounded to bf16 (the optimizer's own seeded generator, checkpointed)"}


def _stray_update(cfg) -> bool:
    """--bf16_update given with fp32 master weights (typed or in the --config file, its default kahan too; a resumed
    run's record is not the user's). On a resume, typing the default is allowed: it clears a bf16 run's recorded
    mode, and the resume contract then names the change of master_weights. Where the setting's origin is not known,
    a value other than the default."""
    from ..config import set_by_user

    typed = set_by_user(cfg, "bf16_update")
    if typed is None or (typed and cfg.resume_from_checkpoint):
        return cfg.bf16_update != "kahan"
    return typed


def check(cfg, prec) -> None:
    """Refuse combinations that make no sense, before the run folder is touched (UsageError)."""
    if cfg.master_weights == "fp32":
        if _stray_update(cfg):
            raise UsageError(f"--bf16_update {cfg.bf16_update} is for --master_weights bf16; fp32 master weights are "
                             f"updated in fp32: add --master_weights bf16 or drop --bf16_update")
        return
    if prec.engine == "deepspeed":
        raise UsageError("--master_weights bf16 is for one process and DDP: DeepSpeed keeps its own fp32 master "
                         "weights in its optimizer; drop --master_weights bf16 or launch without DeepSpeed")
    if prec.effective != "bf16":
        raise UsageError(f"--master_weights bf16 needs --mixed_precision bf16 (this run resolved to "
                         f"{prec.effective}): bf16 weights run under bf16 autocast; fp16 autocast and a GradScaler "
                         f"on bf16 weights, or fp32 compute on bf16 weights, make no sense")
    if cfg.fp32_modules:
        raise UsageError("--fp32_modules keeps modules in fp32 under autocast, but --master_weights bf16 stores every "
                         "weight in bf16: drop one of them")


def describe(precision: PrecisionSettings, engine: str = "torch") -> dict:
    """For the banner and config.yaml: where the master weights live and what they are updated in."""
    if precision.master_weights == "fp32":
        who = "DeepSpeed's optimizer" if engine == "deepspeed" else "torch's AdamW"
        return {"master_weights": "fp32", "master_update": f"in fp32 by {who}, Adam states fp32"}
    return {"master_weights": "bf16", "bf16_update": precision.bf16_update,
            "master_update": f"bf16 in the model (no fp32 copy); AdamW's update computed in fp32 from the upcast "
                             f"weight, {_WHAT[precision.bf16_update]}; Adam states bf16"}


def warning(precision: PrecisionSettings) -> str | None:
    if precision.master_weights == "bf16" and precision.bf16_update == "round":
        return ("warning: --bf16_update round loses every update smaller than half a bf16 step at the weight's "
                "magnitude (lost_update_share in metrics.jsonl); --bf16_update kahan or stochastic keeps them")
    return None


def prepare_model(precision: PrecisionSettings, model: torch.nn.Module, speed_options: dict) -> torch.nn.Module:
    """bf16 master weights: the model's weights (and floating buffers) in bf16; `BF16AdamW` is not fused."""
    if precision.master_weights == "fp32":
        return model
    speed_options["fused_adamw"] = False
    return model.to(torch.bfloat16)


def optimizer(precision: PrecisionSettings, optim: OptimSettings, model: torch.nn.Module, lr: float,
              fused: bool | None):
    """torch's AdamW for fp32 master weights; `BF16AdamW` for bf16 ones (the same parameter groups)."""
    from ..optim import adamw

    plain = adamw(model, lr, optim.weight_decay, fused=fused if precision.master_weights == "fp32" else False)
    if precision.master_weights == "fp32":
        return plain
    return BF16AdamW(plain.param_groups, lr=lr, update=precision.bf16_update, seed=optim.seed)


def ulp(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at |w| (fp32 result): 2**(exponent - mantissa bits); the smallest normal's at 0."""
    info = torch.finfo(dtype)
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}[dtype]
    _, exponent = torch.frexp(w.float().abs().clamp(min=info.tiny))
    return torch.ldexp(torch.ones_like(w, dtype=torch.float32), (exponent - 1 - mantissa).to(torch.float32))


def stochastic_round(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16, rounded up with probability equal to the dropped fraction (unbiased): add 16 random low
    bits to the fp32 pattern, then truncate them."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class BF16AdamW(torch.optim.Optimizer):
    """AdamW on bf16 weights without an fp32 copy (see the module docstring). `state_dtype`: Adam's states."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, update="kahan",
                 seed=0, state_dtype=torch.bfloat16, compensation_dtype=torch.bfloat16):
        if update not in BF16_UPDATES:
            raise ValueError(f"update {update!r} is not one of {BF16_UPDATES}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.update, self.state_dtype, self.compensation_dtype = update, state_dtype, compensation_dtype
        device = self.param_groups[0]["params"][0].device
        self.generator = torch.Generator(device=device).manual_seed(seed) if update == "stochastic" else None
        self.measuring = False  # armed by mixprec.precision.lost_updates on logging steps
        self.measured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (update, before, after)

    def _round(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.update == "stochastic" and dtype == torch.bfloat16:
            return stochastic_round(x, self.generator)
        return x.to(dtype)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = 0  # a Python number: reading it is no device read
            state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
            if self.update == "kahan":
                state["compensation"] = torch.zeros_like(p, dtype=self.compensation_dtype)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.measured = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        state, (beta1, beta2) = self._state(p), group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        state["step"] = step = state["step"] + 1
        grad, w = p.grad.float(), p.float()
        m = state["exp_avg"].float().lerp_(grad, 1 - beta1)
        v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
        update = (m / denom).mul_(-lr / (1 - beta1 ** step)).sub_(w * (lr * decay))
        state["exp_avg"].copy_(self._round(m, self.state_dtype))
        state["exp_avg_sq"].copy_(self._round(v, self.state_dtype))
        if self.update == "kahan":
            comp = state["compensation"]
            before = w + comp.float() if self.measuring else None
            total = update + comp.float()
            new = (w + total).to(p.dtype)
            comp.copy_(total - (new.float() - w))
            p.copy_(new)
            after = p.float() + comp.float() if self.measuring else None
        else:
            before = w if self.measuring else None
            p.copy_(self._round(w + update, p.dtype))
            after = p.float() if self.measuring else None
        if self.measuring:
            self.measured.append((update, before, after))

    def state_dict(self):
        out = super().state_dict()
        if self.generator is not None:
            out["generator_state"] = self.generator.get_state()
        return out

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        generator_state = state_dict.pop("generator_state", None)
        super().load_state_dict(state_dict)  # floating states are cast to the weight's dtype: bf16 stays bf16
        if self.generator is not None and generator_state is not None:
            self.generator.set_state(generator_state.cpu())


@contextlib.contextmanager
def upcast(model: torch.nn.Module, enabled: bool = True):
    """fp32 evaluation of bf16 weights: the weights (and floating buffers) upcast to fp32 for the block, then
    stored back in bf16 (exact both ways: every bf16 value is an fp32 value)."""
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.dtype == torch.bfloat16] if enabled else []
    for t in tensors:
        t.data = t.data.float()
    try:
        yield
    finally:
        for t in tensors:
            t.data = t.data.to(torch.bfloat16)
