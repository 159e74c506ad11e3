"""A health event: what one step began, its cause and the advised fix."""
from __future__ import annotations

from dataclasses import dataclass, field


def _names(modules: list[str], limit: int = 5) -> str:
    return ", ".join(modules[:limit]) + (" ..." if len(modules) > limit else "")


@dataclass
class Event:
    step: int
    event: str  # nan_loss | nonfinite_grad | loss_at_start | lr_too_low | loss_diverging | grad_underflow |
    # skipped_steps | loss_scale_low | loss_flat | labels_unrelated | lost_updates | grad_norm_spike (docs/health.md)
    # | fp32_module_moved (docs/precision.md: --fp32_modules auto)
    value: float
    threshold: float | None
    diagnosis: str
    modules: list[str] = field(default_factory=list)  # the modules responsible (or whose gradients hold inf/NaN)
    cause: str = ""  # a short name of the cause (docs/health.md lists them)
    fix: str = ""  # the advised change: flags ("--lr 0.0001"), or "data: ..." / "code: ..." for a change by hand
    lr: float | None = None  # the step's learning rate
    loss_scale: float | None = None  # fp16: the loss scale after the step, where it was read
    reported_at: int | None = None  # the step it was said on, where later than `step` (a spike, judged after)
    extra: dict = field(default_factory=dict)  # fields of its own (fp32_module_moved: the new fp32_plan)

    def record(self) -> dict:
        out = {"step": self.step, "event": self.event, "value": self.value, "threshold": self.threshold,
               "diagnosis": self.diagnosis}
        if self.modules:
            out["modules"] = ",".join(self.modules)
        out.update({k: v for k, v in (("cause", self.cause), ("fix", self.fix), ("lr", self.lr),
                                      ("loss_scale", self.loss_scale), ("reported_at", self.reported_at))
                    if v not in ("", None)})
        out.update(self.extra)
        return out
