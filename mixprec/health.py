"""Health checks during training: NaN, overflow and stalls, diagnosed as they happen, with the lesson's advice.

The loop calls two methods of `Monitor`:

- `check(loss, grad_norm)` after the gradients are unscaled and clipped, before `optimizer.step()`: one
  host-device sync per optimizer step reads the loss and the gradient norm. A non-finite loss (NaN/Inf),
  or, without a GradScaler (bf16/fp32), a non-finite gradient, marks the step as poisoned: it is not
  applied (fp16: the GradScaler skips it anyway). With several processes the gradient norm is the same on
  every rank, so all ranks decide alike; only then is one flag reduced to learn if any rank's loss was bad.
- `after_step(step)` once the step is counted: feeds `Watch`, which turns what it sees into events
  (a record in metrics.jsonl and the trackers, with `step`, `event` and a `diagnosis`; also printed).
  With `--on_nan halt` a poisoned step stops the run here, before any checkpoint of it is written: the
  last good checkpoint stays the latest, and the process exits with code 3 (`Halted`).

`Monitor` also makes `optimizer.step_was_skipped` true exactly when no update was applied. Accelerate
decides it by whether the GradScaler called the optimizer's `step`; a fused AdamW is always called (it
skips inside its kernel on `found_inf`), so Accelerate reports a skipped step as taken and its scheduler
wrapper advances the learning rate (huggingface/accelerate#4242). The GradScaler halves its scale exactly
when it skips, so a skip is read from the scale instead, for fused and unfused optimizers alike.
"""
from __future__ import annotations

import math
import statistics
import sys
from collections import deque
from dataclasses import dataclass

import torch
from accelerate.utils import DistributedType
from tqdm.auto import tqdm

from . import checkpointing

FP16_MAX = torch.finfo(torch.float16).max  # 65504
FP16_MIN_SUBNORMAL = torch.finfo(torch.float16).tiny * torch.finfo(torch.float16).eps  # 2**-24, about 6e-8
HALT_EXIT_CODE = 3
SPIKE_HISTORY, SPIKE_MIN_HISTORY = 100, 20  # grad norms kept for the median; norms needed before judging


class Halted(SystemExit):
    """`--on_nan halt`: the run stopped on a poisoned step (exit code 3), its diagnosis already reported."""

    def __init__(self, diagnosis: str):
        super().__init__(HALT_EXIT_CODE)
        self.diagnosis = diagnosis


@dataclass
class Event:
    step: int
    event: str  # nan_loss | nonfinite_grad | skipped_steps | loss_scale_low | loss_flat | grad_norm_spike
    value: float
    threshold: float | None
    diagnosis: str

    def record(self) -> dict:
        return {"step": self.step, "event": self.event, "value": self.value, "threshold": self.threshold,
                "diagnosis": self.diagnosis}


class Watch:
    """What the monitor concludes from one optimizer step's numbers (host floats): a pure state machine.

    Each condition is reported when it begins and again only after it has cleared, so a long stall is one
    event, not thousands; a run of skipped steps is reported at K, 2K, 4K, ... steps.
    """

    def __init__(self, precision: str = "no", on_nan: str = "skip", max_skipped_steps: int = 10,
                 min_loss_scale: float = 1.0, flat_loss_window: int = 200, flat_loss_tolerance: float = 0.01,
                 grad_spike_factor: float = 10.0, max_grad_norm: float = 1.0, init_scale: float = 65536.0):
        self.precision, self.on_nan = precision, on_nan
        self.max_skipped, self.min_scale = max_skipped_steps, min_loss_scale
        self.flat_window, self.flat_tol, self.spike = flat_loss_window, flat_loss_tolerance, grad_spike_factor
        self.max_grad_norm, self.init_scale = max_grad_norm, init_scale
        self.losses = deque(maxlen=max(flat_loss_window, 1))
        self.norms = deque(maxlen=SPIKE_HISTORY)
        self.first_losses: list[float] = []
        self.streak = self.steps_taken = 0
        self.nonfinite = None  # the kind of non-finite step last seen, while it lasts
        self.scale_low = self.flat = self.spiking = False
        self.halt: Event | None = None

    @classmethod
    def from_config(cls, cfg, precision: str) -> "Watch":
        return cls(precision, cfg.on_nan, cfg.max_skipped_steps, cfg.min_loss_scale, cfg.flat_loss_window,
                   cfg.flat_loss_tolerance, cfg.grad_spike_factor, cfg.max_grad_norm, cfg.init_scale)

    _STATE = ("losses", "norms", "first_losses", "streak", "steps_taken", "nonfinite", "scale_low", "flat", "spiking")

    def state_dict(self) -> dict:
        """What a checkpoint keeps, so that a resumed run sees (and reports) what an uninterrupted one would."""
        return {k: list(v) if isinstance(v, (deque, list)) else v for k in self._STATE for v in [getattr(self, k)]}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if isinstance(getattr(self, key), deque):
                getattr(self, key).extend(value)
            elif key in self._STATE:
                setattr(self, key, value)

    def describe(self) -> str:
        parts = [f"NaN/Inf (--on_nan {self.on_nan})"]
        if self.max_skipped:
            parts.append(f"{self.max_skipped} skipped steps in a row")
        if self.precision == "fp16" and self.min_scale:
            parts.append(f"loss scale below {self.min_scale:g}")
        if self.flat_window:
            parts.append(f"loss flat (within {self.flat_tol:.1%}) over {self.flat_window} steps")
        if self.spike:
            parts.append(f"gradient norm above {self.spike:g}x its median")
        return ", ".join(parts)

    def observe(self, step: int, *, loss: float, grad_norm: float, nonfinite_loss: bool, skipped: bool,
                scale: float | None, lr: float) -> list[Event]:
        events = []
        self.lr = lr
        kind = ("nan_loss" if nonfinite_loss else
                "nonfinite_grad" if not math.isfinite(grad_norm) and self.precision != "fp16" else None)
        self.halt = None
        if kind and kind != self.nonfinite:
            events.append(self._nonfinite(step, kind, loss, grad_norm))
            self.halt = events[-1] if self.on_nan == "halt" else None
        self.nonfinite = kind

        self.streak = self.streak + 1 if skipped else 0
        self.steps_taken += not skipped
        if self.max_skipped and self.streak >= self.max_skipped and self.streak % self.max_skipped == 0:
            multiple = self.streak // self.max_skipped
            if multiple & (multiple - 1) == 0:  # K, 2K, 4K, ...
                events.append(self._skipped(step, scale))

        if scale is not None and self.min_scale:
            low = scale < self.min_scale
            if low and not self.scale_low:
                events.append(self._scale_low(step, scale))
            self.scale_low = low

        if math.isfinite(loss) and self.flat_window:
            self.losses.append(loss)
            if len(self.first_losses) < 10:
                self.first_losses.append(loss)
            if len(self.losses) == self.flat_window:
                values, half = list(self.losses), self.flat_window // 2
                before, after = statistics.fmean(values[:half]), statistics.fmean(values[half:])
                change = abs(after - before) / max(abs(before), 1e-12)
                flat = change < self.flat_tol
                if flat and not self.flat:
                    events.append(self._flat(step, change, before, after))
                self.flat = flat

        if math.isfinite(grad_norm) and self.spike:
            if len(self.norms) >= SPIKE_MIN_HISTORY:
                median = statistics.median(self.norms)
                spiking = grad_norm > self.spike * median
                if spiking and not self.spiking:
                    events.append(self._spike(step, grad_norm, median))
                self.spiking = spiking
            self.norms.append(grad_norm)
        return events

    # the diagnoses: what was seen, what it usually means, what to do (the lesson's advice)

    def _lower_lr(self) -> str:
        return f"lower the learning rate (now {self.lr:.3g}; e.g. --lr {self.lr / 3:.2g})"

    def _clip(self) -> str:
        if self.max_grad_norm:
            return f"clip gradients harder (--max_grad_norm {self.max_grad_norm:g} now; e.g. {self.max_grad_norm / 2:g})"
        return "clip gradients (clipping is off: e.g. --max_grad_norm 1.0)"

    def _nonfinite(self, step: int, kind: str, loss: float, grad_norm: float) -> Event:
        if kind == "nan_loss":
            what = f"the loss is {loss:g}" if not math.isfinite(loss) else "the loss is NaN/Inf on another process"
            text = (f"{what}. A NaN loss usually means exploding gradients or activations: {self._lower_lr()}; "
                    f"{self._clip()}")
            if self.precision == "fp16":
                text += (f"; in fp16 an activation above {FP16_MAX:g} becomes inf in the forward pass, which loss "
                         f"scaling cannot fix: switch to bf16 (--mixed_precision bf16) or keep the overflowing "
                         f"layers in fp32 (recipes/precision_report.py finds them)")
            value = loss
        else:
            text = (f"the gradients hold inf/NaN (norm {grad_norm:g}) while the loss is finite: exploding gradients. "
                    f"{self._lower_lr().capitalize()}; {self._clip()}")
            value = grad_norm
        text += (". Halted (--on_nan halt) before applying the step or saving it"
                 if self.on_nan == "halt" else ". The step was skipped (--on_nan skip)")
        return Event(step, kind, value, None, text + ".")

    def _skipped(self, step: int, scale: float | None) -> Event:
        if self.precision == "fp16":
            text = (f"the GradScaler skipped {self.streak} optimizer steps in a row (loss scale now {scale:g}): "
                    f"the gradients overflow fp16 at every scale tried. ")
            if self.steps_taken == 0:
                text += (f"No step has been applied yet: --init_scale {self.init_scale:g} is too high for this "
                         f"model; start from the scale it backed off to: --init_scale {scale:g}. ")
            text += (f"If it persists: {self._lower_lr()}; {self._clip()}; look for layers without fp16 support "
                     f"and run them in fp32; or switch to bf16 (--mixed_precision bf16), which has fp32's range.")
        else:
            text = (f"{self.streak} optimizer steps in a row were skipped for NaN/Inf values (--on_nan skip): "
                    f"training is not progressing. {self._lower_lr().capitalize()}; {self._clip()}; "
                    f"--on_nan halt stops at the first bad step.")
        return Event(step, "skipped_steps", self.streak, self.max_skipped, text)

    def _scale_low(self, step: int, scale: float) -> Event:
        text = (f"the loss scale fell to {scale:g}, below --min_loss_scale {self.min_scale:g}: the gradients overflow "
                f"fp16 (max {FP16_MAX:g}) even barely scaled, so fp16's range is too small for this model as "
                f"trained. Switch to bf16 (--mixed_precision bf16); or {self._lower_lr()}, {self._clip()}, and keep "
                f"the overflowing layers in fp32 (recipes/precision_report.py finds them).")
        return Event(step, "loss_scale_low", scale, self.min_scale, text)

    def _flat(self, step: int, change: float, before: float, after: float) -> Event:
        text = (f"the loss moved {change:.2%} over the last {self.flat_window} steps (mean {before:.4g} -> "
                f"{after:.4g}), less than --flat_loss_tolerance {self.flat_tol:.2%}. ")
        start = statistics.fmean(self.first_losses)
        if after > 0.9 * start:
            text += f"It has barely moved since the start ({start:.4g}): vanishing gradients? "
        else:
            text += (f"A plateau after falling from {start:.4g}: expected once the model has converged (fewer "
                     f"--num_epochs would do); if not, ")
        if self.precision == "fp16":
            text += (f"check the scaler: gradients below {FP16_MIN_SUBNORMAL:.2g} flush to zero in fp16 unless the "
                     f"loss scale lifts them (raise --init_scale; recipes/precision_report.py shows how many "
                     f"underflow), or use bf16. ")
        text += (f"Check the learning rate (now {self.lr:.3g}: too low, or decayed already?) and the gradient norm "
                 f"in metrics.jsonl (near zero means vanishing gradients).")
        return Event(step, "loss_flat", change, self.flat_tol, text)

    def _spike(self, step: int, grad_norm: float, median: float) -> Event:
        text = (f"the gradient norm {grad_norm:.3g} is {grad_norm / median:.0f}x its median {median:.3g} over the last "
                f"{len(self.norms)} steps: exploding gradients. {self._lower_lr().capitalize()}; {self._clip()}; "
                f"look for an unusual batch")
        if self.precision == "fp16":
            text += "; in fp16 an overflow (a skipped step, a lower loss scale) often follows"
        return Event(step, "grad_norm_spike", grad_norm, self.spike * median, text + ".")


class Monitor:
    """The loop's health checks (see the module docstring). `enabled=False` (--no-health_checks) keeps only
    the skip detection: no per-step sync, no events, and a NaN in bf16/fp32 is applied as in plain PyTorch."""

    def __init__(self, cfg, accelerator, optimizer, recorder, precision: str, say=print, resumed: dict | None = None):
        self.accelerator, self.optimizer, self.recorder, self.say = accelerator, optimizer, recorder, say
        self.enabled = cfg.health_checks
        self.watch = Watch.from_config(cfg, precision)
        if resumed and "health" in resumed:  # TrainerState.extra of the checkpoint resumed from
            self.watch.load_state_dict(resumed["health"])
        self.scaler = accelerator.scaler
        self.scale = None  # the GradScaler's scale after the last step, read on the host
        self.poisoned = False  # this step's loss (or, without a GradScaler, gradient) is NaN/Inf
        self.numbers = (math.nan, math.nan, False)
        self.step_fn = optimizer.step
        # DeepSpeed steps inside accelerator.backward() (its own fp16 loss scaler skips overflows): nothing to wrap
        self.deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        if not self.deepspeed:
            optimizer.step = self._step  # every caller of optimizer.step() gets the skip detection
        if self.enabled:
            say(f"health checks: {self.watch.describe()}")

    def checkpoint_state(self) -> dict:
        return {"health": self.watch.state_dict()}

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Before optimizer.step(): read the loss and the gradient norm (one host sync) and mark a poisoned step."""
        if not self.enabled:
            return
        grad_norm = torch.as_tensor(grad_norm if grad_norm is not None else math.nan, device=loss.device)
        loss_value, norm_value = torch.stack([loss.detach().float().reshape(()),
                                              grad_norm.detach().float().reshape(())]).tolist()
        nonfinite_loss = not math.isfinite(loss_value)
        if not math.isfinite(norm_value) and self.accelerator.num_processes > 1:
            # every rank is here (the norm is of the all-reduced gradients): did any rank's loss go bad?
            flag = torch.tensor(float(nonfinite_loss), device=self.accelerator.device)
            nonfinite_loss = self.accelerator.reduce(flag, "sum").item() > 0
        self.numbers = (loss_value, norm_value, nonfinite_loss)
        self.poisoned = nonfinite_loss or (self.scaler is None and not math.isfinite(norm_value))

    def _step(self, *args, **kwargs):
        """optimizer.step() with `step_was_skipped` made exact (see the module docstring)."""
        opt = self.optimizer
        if not opt.gradient_state.sync_gradients:  # inside an accumulation window: Accelerate does nothing
            return self.step_fn(*args, **kwargs)
        if self.scaler is None:
            skip = self.poisoned  # bf16/fp32: a non-finite gradient is not applied
            result = None if skip else self.step_fn(*args, **kwargs)
        else:
            before = self.scale if self.scale is not None else self.scaler.get_scale()
            result = self.step_fn(*args, **kwargs)  # GradScaler: step (or not), then update the scale
            self.scale = self.scaler.get_scale()
            skip = self.scale < before  # the scale backs off exactly when the step was skipped
        opt._is_overflow = skip  # what Accelerate's step_was_skipped and its scheduler wrapper read
        return result

    def after_step(self, step: int) -> None:
        """After the step is counted: report what the watch saw; halt on a poisoned step with --on_nan halt."""
        if not self.enabled:
            return
        loss, grad_norm, nonfinite_loss = self.numbers
        events = self.watch.observe(step, loss=loss, grad_norm=grad_norm, nonfinite_loss=nonfinite_loss,
                                    skipped=self.optimizer.step_was_skipped, scale=self.scale,
                                    lr=self.optimizer.param_groups[0]["lr"])
        self.poisoned, self.numbers = False, (math.nan, math.nan, False)
        for event in events:
            self.recorder.log(event.record())
            if event is not self.watch.halt:  # that one goes to stderr, below
                self.say(f"[health] step {event.step}: {event.event}: {event.diagnosis}")
        if self.watch.halt is not None:
            self.halt(self.watch.halt)

    def halt(self, event: Event) -> None:
        out = self.recorder.out
        last = checkpointing.latest(out / "checkpoints")
        resume = (f"The last good checkpoint is {last}: fix the cause, then continue with --resume_from_checkpoint "
                  f"latest --output_dir {out}" if last else "No checkpoint was saved before it: fix the cause and start again")
        self.recorder.finish({"status": "halted", "halted_at_step": event.step, "event": event.event,
                              "diagnosis": event.diagnosis, "last_checkpoint": str(last or "")})
        if self.accelerator.is_main_process:
            tqdm.write(f"error: halted at step {event.step} ({event.event}): {event.diagnosis} {resume}.",
                       file=sys.stderr)  # on a line of its own, clear of the progress bar
        self.accelerator.end_training()
        raise Halted(event.diagnosis)
