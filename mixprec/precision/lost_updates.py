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

import torch

from ..health.event import Event
from .master_weights import BF16AdamW, ulp

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
    def __init__(self, optimizer, cfg, total_steps: int):
        self.optimizer, self.log_every, self.total = optimizer, cfg.log_every, total_steps
        self.own = isinstance(optimizer, BF16AdamW)
        self.dtype = torch.bfloat16 if self.own else torch.float32
        self.watch = LostWatch(cfg.master_weights, cfg.bf16_update)
        self.armed, self.snapshot, self.result, self.count_before = False, None, None, None
        self.enabled = cfg.lost_updates  # --no-lost_updates: no hooks, no work, no metric
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
        elif self._step_count() in (self.count_before, 0.0):
            # a fused AdamW under the GradScaler is called on an inf/NaN step too and skips it itself (its step
            # count stays, or is 0 when the first step is skipped: its states are made, empty): no update was made
            triples, self.snapshot = [], None
        else:
            triples = [(self._adamw_update(p, old), old, p.detach().float())
                       for p, old in zip(self._params(), self.snapshot)]
            self.snapshot = None
        self.result = self._summarise(triples)

    def _adamw_update(self, p: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """The update torch's AdamW computed, from its states after the step (fp32)."""
        group = next(g for g in self.optimizer.param_groups if any(q is p for q in g["params"]))
        state, (beta1, beta2) = self.optimizer.state[p], group["betas"]
        step = state["step"].to(device=p.device, dtype=torch.float32)
        denom = (state["exp_avg_sq"].float().sqrt() / (1 - beta2 ** step).sqrt()).add_(group["eps"])
        lr = group["lr"]
        return -(lr / (1 - beta1 ** step)) * state["exp_avg"].float() / denom - old * (lr * group["weight_decay"])

    def _summarise(self, triples) -> torch.Tensor | None:
        if not triples:
            return None
        moved = [u != 0 for u, _, _ in triples]
        nonzero = sum(m.sum() for m in moved)
        lost = sum((m & (after == before)).sum() for m, (_, before, after) in zip(moved, triples))
        ratios = torch.cat([(u.abs() / ulp(before, self.dtype))[m] for m, (u, before, _) in zip(moved, triples)])
        median = ratios.median() if ratios.numel() else torch.tensor(float("nan"))
        return torch.stack([torch.as_tensor(nonzero).float(), torch.as_tensor(lost).float(), median.float()])

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
