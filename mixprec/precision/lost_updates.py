"""The lost-update metric, measured on logging steps only (no work, no device read on the other steps).

On the optimizer step of each logging step (armed by the run the step before), for every parameter element:

- `lost_update_share`: the share of elements whose optimizer update was non-zero but whose stored weight did not
  change. With --bf16_update kahan the stored value is weight + compensation (what Kahan summation keeps); with
  `stochastic` an unchanged weight is not lost, only deferred: it moves by a whole bf16 step with the probability
  that makes the rounding unbiased.
- `update_ulp_ratio`: the median |update| / ulp(weight), the update against the spacing of the weights' dtype at
  the weight's magnitude. Round-to-nearest loses an update below 0.5.

The update is the one AdamW computed: `BF16AdamW` hands it over; for torch's AdamW (fp32 master weights) it is
recomputed from the optimizer's states after the step, against a copy of the weights taken before it.
A run that loses most updates where nothing carries them forward (fp32 master weights, --bf16_update round) gets
one health event when it begins, naming the cause and the fix (`LostWatch`); it ends when the share falls again.
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import torch

from ..health.event import Event
from .master_weights import BF16AdamW

if TYPE_CHECKING:
    from ..config.sections import HealthSettings, PrecisionSettings, RunFolderSettings

LOSING = 0.5  # a share of lost updates above this is diagnosed


class LostWatch:
    def __init__(self, master_weights: str, bf16_update: str):
        self.mode = "fp32" if master_weights == "fp32" else bf16_update
        self.losing = False

    def observe(self, step: int, share: float, ratio: float, lr: float) -> Event | None:
        if self.mode in ("kahan", "stochastic"):  # small updates are carried forward, not lost
            return None
        losing = share > LOSING
        begins, self.losing = losing and not self.losing, losing
        if not begins:
            return None
        if self.mode == "round":
            text = (f"{share:.0%} of this step's non-zero updates left the bf16 weights unchanged (the median update "
                    f"is {ratio:.2g} of a bf16 step at the weight's magnitude; below 0.5 rounds away): "
                    f"round-to-nearest on bf16 weights is losing the updates. Keep them with --bf16_update kahan "
                    f"(a bf16 compensation buffer, 2 bytes per parameter) or --bf16_update stochastic, or train "
                    f"with --master_weights fp32")
        else:
            text = (f"{share:.0%} of this step's non-zero updates left the fp32 weights unchanged (the median update "
                    f"is {ratio:.2g} of an fp32 step at the weight's magnitude): the learning rate (now {lr:.3g}) is "
                    f"too small for weights of this size to move; raise --lr")
        cause, fix = ("lost_updates", "--bf16_update kahan") if self.mode == "round" else ("lr_too_low", "--lr 0.001")
        return Event(step, "lost_updates", share, LOSING, text + ".", [], cause, fix, lr)


class LostUpdates:
    def __init__(self, optimizer, health: HealthSettings, run_folder: RunFolderSettings, precision: PrecisionSettings,
                 total_steps: int):
        self.optimizer, self.log_every, self.total = optimizer, run_folder.log_every, total_steps
        self.own = isinstance(optimizer, BF16AdamW)
        self.dtype = torch.bfloat16 if self.own else torch.float32
        self.watch = LostWatch(precision.master_weights, precision.bf16_update)
        self.armed, self.snapshot, self.result, self.count_before = False, None, None, None
        self.enabled = health.lost_updates  # --no-lost_updates: no hooks, no work, no metric
        if not self.enabled:
            return
        if not self.own:
            optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)

    def after(self, step: int) -> None:
        """Called once `step` optimizer steps are done: arm the measurement when the next step logs."""
        nxt = step + 1
        if not self.enabled:
            return
        self.armed = nxt % self.log_every == 0 or nxt == self.total
        if self.own:
            self.optimizer.measuring = self.armed

    def _params(self):
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def _step_count(self) -> float | None:
        """The first parameter's AdamW step count (None before its first step)."""
        params = self._params()
        state = self.optimizer.state.get(params[0], {}) if params else {}
        return float(state["step"]) if "step" in state else None

    def _before(self, optimizer, args, kwargs) -> None:
        if self.armed:
            self.count_before = self._step_count()
            self.snapshot = [p.detach().float() if p.dtype != torch.float32 else p.detach().clone()
                             for p in self._params()]

    def _after(self, optimizer, args, kwargs) -> None:
        if not self.armed:
            return
        self.armed = False
        if self.own:
            triples, self.optimizer.measuring, self.optimizer.measured = self.optimizer.measured, False, []
            self.result = _summarise(triples, self.dtype)
        elif self._step_count() in (self.count_before, 0.0):
            # a fused AdamW under the GradScaler is called on an inf/NaN step too and skips it itself (its step
            # count stays, or is 0 when the first step is skipped: its states are made, empty): no update was made
            self.snapshot, self.result = None, None
        else:
            pairs, self.snapshot = list(zip(self._params(), self.snapshot)), None
            self.result = _summarise([(self._adamw_update(p), old, p.detach()) for p, old in pairs], self.dtype)

    def _adamw_update(self, p: torch.Tensor):
        """The update torch's AdamW computed, from its states after the step (fp32), as a function of (a slice of
        the flattened weights before the step, that slice), so that its temporaries stay as small as the slice."""
        group = next(g for g in self.optimizer.param_groups if any(q is p for q in g["params"]))
        state, (beta1, beta2) = self.optimizer.state[p], group["betas"]
        step = state["step"].to(device=p.device, dtype=torch.float32)
        root, scale = (1 - beta2 ** step).sqrt(), -(group["lr"] / (1 - beta1 ** step))
        avg, avg_sq = state["exp_avg"].float().reshape(-1), state["exp_avg_sq"].float().reshape(-1)
        decay = group["lr"] * group["weight_decay"]

        def update(old: torch.Tensor, part: slice) -> torch.Tensor:
            denom = avg_sq[part].sqrt().div_(root).add_(group["eps"])
            return torch.mul(scale, avg[part]).div_(denom).sub_(old * decay)
        return update

    def read(self, step: int, report) -> dict:
        """At a logging step: the metric (one device read) and, through `report`, a health event if one begins."""
        if self.result is None:  # the step was skipped (NaN/Inf)
            return {}
        nonzero, lost, ratio = self.result.tolist()
        self.result = None
        share = lost / nonzero if nonzero else 0.0
        event = self.watch.observe(step, share, ratio, self.optimizer.param_groups[0]["lr"])
        if event is not None:
            report(event)
        return {"lost_update_share": share, "update_ulp_ratio": ratio}

    def state_dict(self) -> dict:
        return {"losing": self.watch.losing}

    def load_state_dict(self, state: dict) -> None:
        self.watch.losing = state.get("losing", False)


CHUNK = 1 << 18  # elements per pass on a CPU (1 MB of fp32): the temporaries stay in the cache
MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
ZERO_UPDATE = torch.tensor(-1.0)  # the ratio written where an update is zero (a real ratio is >= 0 or NaN)


def _summarise(triples: list, dtype: torch.dtype) -> torch.Tensor | None:
    """[non-zero updates, lost ones, median |update| / ulp(before) over the non-zero ones] over `triples`: (update,
    weights before, after), the update a tensor or a function of (a slice of the flattened weights before, that
    slice). Slice by slice on a CPU: each element is read once, and only the ratios are kept (the median is exact)."""
    if not triples:
        return None
    device = triples[0][1].device
    total = sum(before.numel() for _, before, _ in triples)
    ratios = torch.empty(total, dtype=torch.float32, device=device)
    counts = torch.zeros(2, dtype=torch.int64, device=device)  # non-zero updates, lost ones
    at = 0
    for update, before, after in triples:
        before, after, n = before.reshape(-1), after.reshape(-1), before.numel()
        width = CHUNK if device.type == "cpu" else n
        for start in range(0, n, width):
            part = slice(start, min(start + width, n))
            u = update(before[part], part) if callable(update) else update.reshape(-1)[part]
            _tally(u, before[part].float(), after[part].float(), dtype, counts, ratios[at + part.start:at + part.stop])
        at += n
    if int(counts[0]) < total:  # some updates were zero: the median is over the others
        ratios = ratios[ratios != -1.0]
    median = ratios.median() if ratios.numel() else torch.tensor(float("nan"), device=device)
    return torch.cat([counts.float(), median.float().reshape(1)])


def _tally(u: torch.Tensor, before: torch.Tensor, after: torch.Tensor, dtype: torch.dtype, counts: torch.Tensor,
           ratios: torch.Tensor) -> None:
    """Count one slice's non-zero and lost updates into `counts`; write |u| / ulp(before) into `ratios` (-1 where
    the update is zero). ulp as master_weights.ulp computes it, read off the exponent bits: 2**(exponent - mantissa
    bits of `dtype`) at |before|, at `dtype`'s smallest normal below it (exact, a subnormal spacing included)."""
    moved = u != 0
    counts[0] += moved.sum()
    counts[1] += (after == before).logical_and_(moved).sum()
    smallest = struct.unpack("<i", struct.pack("<f", torch.finfo(dtype).tiny))[0]  # its bits: its exponent's
    exponent = before.contiguous().view(torch.int32).bitwise_and(0x7F800000).clamp_(min=smallest)
    spacing = exponent.view(torch.float32).mul_(2.0 ** -MANTISSA[dtype])
    torch.where(moved, u.abs().div_(spacing), ZERO_UPDATE.to(ratios.device), out=ratios)
