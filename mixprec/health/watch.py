"""The health watch: what one optimizer step's numbers (host floats) mean, as a pure state machine, with the
lesson's advice. `mixprec.health.monitor` feeds it.

Each condition is reported when it begins and again only after it has cleared, so a long stall is one event,
not thousands; a run of skipped steps is reported at K, 2K, 4K, ... steps. A healthy run gets no event:
a loss that levels off after falling (a converging run late in a decaying schedule) is a plateau, not a
stall; only a loss that has stayed flat without falling by `PROGRESS` from where it started is a stall.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass

import torch

from . import advice
from .advice import CHANCE_FACTOR, LR_FLOOR
from .event import Event, _names

FP16_MAX = torch.finfo(torch.float16).max  # 65504
FP16_MIN_SUBNORMAL = torch.finfo(torch.float16).tiny * torch.finfo(torch.float16).eps  # 2**-24, about 6e-8
SPIKE_HISTORY, SPIKE_MIN_HISTORY = 100, 20  # grad norms kept for the median; norms needed before judging
PROGRESS = 0.1  # a loss that has fallen by this fraction from its start is learning, however flat it is now
FIRST_LOSSES = 10  # steps whose mean is the starting loss
DIVERGE_FACTOR = 2.0  # a loss above this many times the first one: diverging
EARLY_SKIPS = 3  # fp16: after this many skipped steps in a row, check whether any loss scale fits
ZERO_GRAD_STEPS = 2  # fp16: this many applied steps in a row with a zero gradient norm and a non-zero loss
SPIKE_CONFIRM = 4  # steps after a gradient norm spike whose losses decide whether it is exploding gradients
SPIKE_RISE = 0.5  # ... it is when their mean is this fraction above the median loss of the steps before it


@dataclass
class Suspect:
    """A gradient norm spike waiting for the losses of the steps after it: a model leaving a plateau also makes
    the norm jump (and learns); exploding gradients make the loss rise."""
    step: int
    grad_norm: float
    median: float  # the norm's median before the spike
    lr: float
    scale: float | None
    loss_before: float  # the median loss of the steps before the spike
    after: list[float]  # the losses of the steps after it


class Watch:
    """What the monitor concludes from one optimizer step's numbers (host floats): a pure state machine.

    Each condition is reported when it begins and again only after it has cleared, so a long stall is one
    event, not thousands; a run of skipped steps is reported at K, 2K, 4K, ... steps.
    """

    def __init__(self, precision: str = "no", on_nan: str = "skip", max_skipped_steps: int = 10,
                 min_loss_scale: float = 1.0, flat_loss_window: int = 200, flat_loss_tolerance: float = 0.01,
                 grad_spike_factor: float = 10.0, max_grad_norm: float = 1.0, init_scale: float = 65536.0,
                 base_lr: float = 1e-3, classes: int | None = None, label_probe_samples: int = 0):
        self.precision, self.on_nan = precision, on_nan
        self.max_skipped, self.min_scale = max_skipped_steps, min_loss_scale
        self.flat_window, self.flat_tol, self.spike = flat_loss_window, flat_loss_tolerance, grad_spike_factor
        self.max_grad_norm, self.init_scale = max_grad_norm, init_scale
        self.base_lr, self.classes = base_lr, classes
        self.inspect = lambda unscaled=False: {}  # the monitor's look at the step's batch and model (mixprec.health.causes)
        self.lrs = deque(maxlen=max(flat_loss_window, 1))
        self.first_norms: list[float] = []
        self.first_loss, self.zero_grads, self.diverging, self.cause = None, 0, False, None
        self.losses = deque(maxlen=max(flat_loss_window, 1))
        self.norms = deque(maxlen=SPIKE_HISTORY)
        self.recent_losses = deque(maxlen=SPIKE_MIN_HISTORY)  # the loss before a spike
        self.suspect: Suspect | None = None
        self.first_losses: list[float] = []
        self.streak = self.steps_taken = 0
        self.nonfinite = None  # the kind of non-finite step last seen, while it lasts
        self.scale_low = self.flat = self.spiking = False
        self.halt: Event | None = None
        self.probe_samples = label_probe_samples
        self.label_ratio: float | None = None  # the label probe's ratio (mixprec.health.coherence)
        self.said_unrelated = False  # the label probe found nothing to learn

    @classmethod
    def from_config(cls, cfg, precision: str) -> "Watch":
        return cls(precision, cfg.on_nan, cfg.max_skipped_steps, cfg.min_loss_scale, cfg.flat_loss_window,
                   cfg.flat_loss_tolerance, cfg.grad_spike_factor, cfg.max_grad_norm, cfg.init_scale, cfg.lr,
                   label_probe_samples=cfg.label_probe_samples)

    _STATE = ("losses", "norms", "first_losses", "streak", "steps_taken", "nonfinite", "scale_low", "flat", "spiking",
              "lrs", "first_norms", "first_loss", "zero_grads", "diverging", "cause", "label_ratio", "said_unrelated",
              "recent_losses")

    def state_dict(self) -> dict:
        """What a checkpoint keeps, so that a resumed run sees (and reports) what an uninterrupted one would."""
        state = {k: list(v) if isinstance(v, (deque, list)) else v for k in self._STATE for v in [getattr(self, k)]}
        state["suspect"] = asdict(self.suspect) if self.suspect else None
        return state

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if isinstance(getattr(self, key, None), deque):
                getattr(self, key).extend(value)
            elif key in self._STATE:
                setattr(self, key, value)
        self.suspect = Suspect(**state["suspect"]) if state.get("suspect") else None

    def describe(self) -> str:
        parts = [f"NaN/Inf (--on_nan {self.on_nan})"]
        if self.max_skipped:
            parts.append(f"{self.max_skipped} skipped steps in a row")
        if self.precision == "fp16" and self.min_scale:
            parts.append(f"loss scale below {self.min_scale:g}")
        if self.flat_window:
            parts.append(f"a stalled loss (flat within {self.flat_tol:.1%} over {self.flat_window} steps, not below "
                         f"its start)")
        if self.spike:
            parts.append(f"gradient norm above {self.spike:g}x its median with the loss rising after it")
        return ", ".join(parts)

    def observe(self, step: int, *, loss: float, grad_norm: float, nonfinite_loss: bool, skipped: bool,
                scale: float | None, lr: float, modules: list[str] | None = None) -> list[Event]:
        """The events that step `step` begins. `skipped`: the step was not applied; `modules`: where the
        gradients held inf/NaN (non-finite steps only); `lr`: the step's learning rate."""
        events = []
        self.lr, self.scale = lr, scale
        kind = ("nan_loss" if nonfinite_loss else
                "nonfinite_grad" if not math.isfinite(grad_norm) and self.precision != "fp16" else None)
        self.halt = None
        if kind and kind != self.nonfinite:
            events.append(self._nonfinite(step, kind, loss, grad_norm, skipped, modules or []))
            self.halt = events[-1] if self.on_nan == "halt" else None
        self.nonfinite = kind

        self.streak = self.streak + 1 if skipped else 0
        if not skipped:
            self.cause = None  # a streak's cause lasts while the streak does
        self.steps_taken += not skipped
        if (self.precision == "fp16" and self.streak == EARLY_SKIPS and not self.cause and math.isfinite(loss)
                and self.streak != self.max_skipped):
            early = advice.fp16_overflow(self, step, scale, modules or [])
            if early is not None and early.cause == "loss_scale_collapse":
                events.append(early)  # said now, not at --max_skipped_steps
        if self.max_skipped and self.streak >= self.max_skipped and self.streak % self.max_skipped == 0:
            multiple = self.streak // self.max_skipped
            if multiple & (multiple - 1) == 0:  # K, 2K, 4K, ...
                events.append(self._skipped(step, scale, modules or []))

        if scale is not None and self.min_scale:
            low = scale < self.min_scale
            if low and not self.scale_low:
                events.append(self._scale_low(step, scale))
            self.scale_low = low

        if math.isfinite(loss):
            events += self._watch_start(step, loss, grad_norm, skipped)
            self.lrs.append(lr)
            if self.flat_window:
                events += self._watch_flat(step, loss)

        if self.spike:
            events += self._watch_spike(step, loss, grad_norm)
        for event in events:
            if event.lr is None:  # a confirmed spike carries its own step's
                event.lr, event.loss_scale = lr, scale
        return events

    def _watch_spike(self, step: int, loss: float, grad_norm: float) -> list[Event]:
        """A gradient norm above `spike` times its median (and above the run's early norms: a converged run's tiny
        gradients jumping is not a spike) is a suspect; it is exploding gradients, reported on its own step, when
        the loss of the SPIKE_CONFIRM steps after it averages SPIKE_RISE above the loss before it."""
        events = []
        if self.suspect is not None:
            if not math.isfinite(loss):
                self.suspect = None  # the non-finite loss's own event names its cause
            else:
                self.suspect.after.append(loss)
                if len(self.suspect.after) == SPIKE_CONFIRM:
                    if statistics.fmean(self.suspect.after) > (1 + SPIKE_RISE) * self.suspect.loss_before:
                        events.append(self._spike(self.suspect, step))
                    else:
                        self.spiking = False  # cleared: a norm still high now is judged afresh
                    self.suspect = None
        if math.isfinite(grad_norm):
            if len(self.first_norms) < SPIKE_MIN_HISTORY:
                self.first_norms.append(grad_norm)
            if len(self.norms) >= SPIKE_MIN_HISTORY:
                median = statistics.median(self.norms)
                spiking = (median > 0 and grad_norm > self.spike * median
                           and grad_norm > statistics.median(self.first_norms))
                if spiking and not self.spiking and self.suspect is None and self.recent_losses:
                    self.suspect = Suspect(step, grad_norm, median, self.lr, self.scale,
                                           statistics.median(self.recent_losses), [])
                self.spiking = spiking
            self.norms.append(grad_norm)
        if math.isfinite(loss):
            self.recent_losses.append(loss)
        return events

    def _watch_start(self, step: int, loss: float, grad_norm: float, skipped: bool) -> list[Event]:
        """A first loss far above chance level; a loss that climbs above twice the first; fp16 gradients that
        are all zero while the loss is not."""
        events = []
        chance = math.log(self.classes) if self.classes and self.classes > 1 else None
        if self.first_loss is None:
            self.first_loss = loss
            if chance and loss > CHANCE_FACTOR * chance:
                events.append(advice.at_start(self, step, loss, chance))
            if 0 < self.base_lr < LR_FLOOR:
                events.append(advice.lr_far_too_low(self, step))
        # twice the first loss and a nat above it: a fine-tuning run's tiny first loss may double in noise
        diverging = loss > max(DIVERGE_FACTOR * self.first_loss, self.first_loss + 1.0) and self.first_loss > 0
        if diverging and not self.diverging:
            events.append(advice.diverging(self, step, loss))
        self.diverging = diverging
        zero = self.precision == "fp16" and not skipped and grad_norm == 0 and loss > 0
        self.zero_grads = self.zero_grads + 1 if zero else 0
        if self.zero_grads == ZERO_GRAD_STEPS:
            events.append(advice.underflow(self, step, loss))
        return events

    def _watch_flat(self, step: int, loss: float) -> list[Event]:
        """A stall: the window's two halves differ by less than the tolerance and the loss has not fallen by
        PROGRESS from its start. It ends when the loss moves by twice the tolerance, or falls below that mark."""
        self.losses.append(loss)
        if len(self.first_losses) < FIRST_LOSSES:
            self.first_losses.append(loss)
        if len(self.losses) < self.flat_window:
            return []
        values, half = list(self.losses), self.flat_window // 2
        before, after = statistics.fmean(values[:half]), statistics.fmean(values[half:])
        change = abs(after - before) / max(abs(before), 1e-12)
        start = statistics.fmean(self.first_losses)
        learning = after < (1 - PROGRESS) * start
        if self.flat:
            self.flat = not learning and change < 2 * self.flat_tol
            return []
        self.flat = change < self.flat_tol and not learning
        event = self._flat(step, change, before, after, start) if self.flat else None
        return [event] if event is not None else []

    def wants_labels(self) -> bool:
        """Whether the labels are to be probed now (mixprec.health.coherence): a classification run not judged
        yet."""
        return bool(self.probe_samples) and self.label_ratio is None and bool(self.classes and self.classes > 1)

    def observe_labels(self, step: int, ratio: float, rows: int) -> list[Event]:
        """The probe's ratio: the label-dependent part of the gradient with the real labels over that with
        permuted labels, on `rows` training rows. Below the floor: nothing in the inputs predicts the labels."""
        self.label_ratio = ratio
        if ratio >= advice.COHERENCE_FLOOR or rows < advice.COHERENCE_ROWS:
            return []
        self.said_unrelated = True
        event = advice.labels_unrelated(self, step, ratio, rows)
        event.lr, event.loss_scale = getattr(self, "lr", None), getattr(self, "scale", None)
        return [event]

    # the diagnoses: what was seen, what it usually means, what to do (the lesson's advice)

    def _lower_lr(self) -> str:
        return f"lower the learning rate (now {self.lr:.3g}; e.g. --lr {self.lr / 3:.2g})"

    def _clip(self) -> str:
        if self.max_grad_norm:
            return f"clip gradients harder (--max_grad_norm {self.max_grad_norm:g} now; e.g. {self.max_grad_norm / 2:g})"
        return "clip gradients (clipping is off: e.g. --max_grad_norm 1.0)"

    def _nonfinite(self, step: int, kind: str, loss: float, grad_norm: float, skipped: bool,
                   modules: list[str]) -> Event:
        where = f" Non-finite gradients in: {_names(modules)}." if modules else ""
        cause = advice.found(self, self.steps_taken == 0)
        if cause is not None:
            what = f"the loss is {loss:g}" if kind == "nan_loss" else f"the gradients hold inf/NaN (norm {grad_norm:g})"
            text = f"{what}.{where} Cause: {cause[2]}"
            self.cause = cause
        elif kind == "nan_loss":
            what = f"the loss is {loss:g}" if not math.isfinite(loss) else "the loss is NaN/Inf on another process"
            text = (f"{what}.{where} A NaN loss usually means exploding gradients or activations: "
                    f"{self._lower_lr()}; {self._clip()}")
            if self.precision == "fp16":
                text += (f"; in fp16 an activation above {FP16_MAX:g} becomes inf in the forward pass, which loss "
                         f"scaling cannot fix: switch to bf16 (--mixed_precision bf16) or keep the overflowing "
                         f"layers in fp32 (recipes/precision_report.py finds them and prints the --fp32_modules flag)")
        else:
            text = (f"the gradients hold inf/NaN (norm {grad_norm:g}) while the loss is finite: exploding "
                    f"gradients.{where} {self._lower_lr().capitalize()}; {self._clip()}")
        value = loss if kind == "nan_loss" else grad_norm
        if self.on_nan == "halt":
            text += ". Halted (--on_nan halt) before applying the step or saving it"
        elif skipped:
            text += ". The step was skipped (--on_nan skip)"
        else:
            text += ". The step was applied: the weights may now hold NaN/Inf (resume from the last checkpoint)"
        name, fix = (cause[0], cause[1]) if cause else ("exploding_gradients", f"--lr {self.base_lr / 10:.2g}")
        return Event(step, kind, value, None, text + ".", list(cause[3] if cause and cause[3] else modules),
                     name, fix)

    def _skipped(self, step: int, scale: float | None, modules: list[str]) -> Event:
        where = f" This step's non-finite gradients are in: {_names(modules)}." if modules else ""
        steps = f"{self.streak} optimizer step{'s' * (self.streak != 1)} in a row"
        if self.cause:  # the streak's first step named it
            text = f"{steps} skipped, all for the cause already reported: {self.cause[2]}."
            return Event(step, "skipped_steps", self.streak, self.max_skipped, text, list(self.cause[3] or modules),
                         self.cause[0], self.cause[1])
        if self.precision == "fp16":
            measured = advice.fp16_overflow(self, step, scale, modules)
            if measured is not None:
                measured.threshold = self.max_skipped
                return measured
            now = f" (loss scale now {scale:g})" if scale is not None else ""
            text = (f"the GradScaler skipped {steps}{now}: "
                    f"the gradients overflow fp16 at every scale tried.{where} ")
            if self.steps_taken == 0:
                start = f"--init_scale {scale:g}" if scale is not None else "a lower --init_scale"
                text += (f"No step has been applied yet: --init_scale {self.init_scale:g} is too high for this "
                         f"model; start from the scale it backed off to: {start}. ")
            text += (f"If it persists: {self._lower_lr()}; {self._clip()}; look for layers without fp16 support "
                     f"and run them in fp32 (--fp32_modules; recipes/precision_report.py prints the flag); "
                     f"or switch to bf16 (--mixed_precision bf16), which has fp32's range.")
        else:
            text = (f"{steps} {'were' if self.streak != 1 else 'was'} skipped for NaN/Inf values (--on_nan skip): "
                    f"training is not progressing.{where} {self._lower_lr().capitalize()}; {self._clip()}; "
                    f"--on_nan halt stops at the first bad step.")
        if self.precision == "fp16" and self.steps_taken == 0 and scale is not None:
            name, fix = "init_scale_too_high", f"--init_scale {scale:g}"
        else:
            name, fix = ("fp16_grad_overflow", "--mixed_precision bf16") if self.precision == "fp16" else (
                "exploding_gradients", f"--lr {self.base_lr / 10:.2g}")
        return Event(step, "skipped_steps", self.streak, self.max_skipped, text, list(modules), name, fix)

    def _scale_low(self, step: int, scale: float) -> Event:
        if self.cause:
            text = f"the loss scale fell to {scale:g}, for the cause already reported: {self.cause[2]}."
            return Event(step, "loss_scale_low", scale, self.min_scale, text, list(self.cause[3]), self.cause[0],
                         self.cause[1])
        text = (f"the loss scale fell to {scale:g}, below --min_loss_scale {self.min_scale:g}: the gradients overflow "
                f"fp16 (max {FP16_MAX:g}) even barely scaled, so fp16's range is too small for this model as "
                f"trained. Switch to bf16 (--mixed_precision bf16); or {self._lower_lr()}, {self._clip()}, and keep "
                f"the overflowing layers in fp32 (recipes/precision_report.py finds them).")
        return Event(step, "loss_scale_low", scale, self.min_scale, text, [], "loss_scale_collapse",
                     "--mixed_precision bf16")

    def _flat(self, step: int, change: float, before: float, after: float, start: float) -> Event | None:
        text = (f"the loss moved {change:.2%} over the last {self.flat_window} steps (mean {before:.4g} -> "
                f"{after:.4g}), less than --flat_loss_tolerance {self.flat_tol:.2%}, and has not fallen from where "
                f"it started ({start:.4g}): training is stalled. ")
        name, fix, why = advice.stall(self, after)
        if name == "no_signal" and self.said_unrelated:
            return None  # the label probe said it already
        if name:
            return Event(step, "loss_flat", change, self.flat_tol, text + why + ".", [], name, fix)
        text += (f"Check the learning rate (now {self.lr:.3g}: zero, "
                f"or far too low?) and the gradient norm in metrics.jsonl (near zero means vanishing gradients). ")
        if self.precision == "fp16":
            text += (f"In fp16, check the scaler: gradients below {FP16_MIN_SUBNORMAL:.2g} flush to zero unless the "
                     f"loss scale lifts them (raise --init_scale; recipes/precision_report.py shows how many "
                     f"underflow), or use bf16.")
        return Event(step, "loss_flat", change, self.flat_tol, text.strip(), [], "stall")

    def _spike(self, suspect: Suspect, now: int) -> Event:
        lr, after = suspect.lr, statistics.fmean(suspect.after)
        text = (f"the gradient norm {suspect.grad_norm:.3g} was {suspect.grad_norm / suspect.median:.0f}x its median "
                f"{suspect.median:.3g}, and the loss of the {SPIKE_CONFIRM} steps after it averaged {after:.4g}, "
                f"up from {suspect.loss_before:.4g}: exploding gradients. Lower the learning rate (it was {lr:.3g}; "
                f"e.g. --lr {lr / 3:.2g}); {self._clip()}; look for an unusual batch")
        if self.precision == "fp16":
            text += "; in fp16 an overflow (a skipped step, a lower loss scale) often follows"
        event = Event(suspect.step, "grad_norm_spike", suspect.grad_norm, self.spike * suspect.median, text + ".", [],
                      "exploding_gradients", f"--lr {self.base_lr / 10:.2g}")
        event.lr, event.loss_scale, event.reported_at = lr, suspect.scale, now
        return event
