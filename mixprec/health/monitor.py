"""The loop's health checks, with one host read per optimizer step and nothing else on the hot path.

- `add_loss(loss)` after each micro-batch's backward: sums the loss on the device (for the log, and so that
  a NaN in any micro-batch of an accumulation window is seen); the step's first micro-batch is kept as it is.
- `allows_step(grad_norm)` before `optimizer.step()`: reads the step's loss and gradient norm from the device
  in one go (the one host-device sync of the health checks) and decides from them whether the step holds
  NaN/Inf. The values read are what the watch later sees (rounded to float32, as before) and, where losses are
  summed in float64, what the logging window sums on the host (the same float64 additions the device made),
  so that a step without accumulation costs two tensor operations (the loss's detach and the read's stack)
  and nothing is kept per step for the logging step to read again (tests/test_host_reads.py counts both).
  On such a step it names
  the modules whose gradients hold inf/NaN (earliest in the forward pass first; the work is done on these
  steps only), and with --on_nan halt stops the run before the step is applied (exit code 3). It returns
  False when the recipe must not apply the step: bf16/fp32 with NaN/Inf (fp16: the GradScaler skips it
  itself and lowers the scale; DeepSpeed decided inside `backward`).
- `step_done()` after the step: counts it, skipped or not.
- `window()` at a logging step: the window's mean loss, the last gradient norm and the skipped steps, read
  in one go.
The watch sees each step's values (the floats `allows_step` read, the step's learning rate, the loss scale
where a bad step read it) when the step is done, and its events are reported then, on the step they are
about. An event that needs a cause looks at the step's micro-batches and model then (`causes.inspect`: event
steps only).

With --no-health_checks there is no per-step read: fp16 steps are still skipped by the GradScaler (counted
on the device), bf16/fp32 steps with NaN/Inf are applied as in plain PyTorch, and nothing is diagnosed.
"""
from __future__ import annotations

import math
import struct

import torch

from ..evaluation import accumulation_dtype
from ..unwrap import unwrap
from . import advice, causes, coherence
from .watch import Event, Watch

HALT_EXIT_CODE = 3


class Halted(SystemExit):
    """`--on_nan halt`: the run stopped on a NaN/Inf step (exit code 3), its diagnosis already reported."""

    def __init__(self, diagnosis: str):
        super().__init__(HALT_EXIT_CODE)
        self.diagnosis = diagnosis


def forward_order(model: torch.nn.Module, example: dict) -> list[str]:
    """The names of the model's modules in the order a forward pass calls them (one sample, no gradients, in
    eval mode: batch-norm statistics and the random state are left as they were)."""
    seen: list[str] = []
    hooks = [module.register_forward_pre_hook(lambda m, a, name=name: seen.append(name))
             for name, module in model.named_modules() if name]
    modes = {module: module.training for module in model.modules()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model.eval()(example["inputs"][:1])
    finally:
        for module, mode in modes.items():
            module.training = mode
        for hook in hooks:
            hook.remove()
    return list(dict.fromkeys(seen))


def _float32(value: float) -> float:
    """`value` rounded to float32, as `.float()` rounds a tensor (inf beyond float32's range), in under a
    microsecond (numpy.float32 under numpy.errstate takes about 7 us)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond float32's largest value after rounding
        return math.copysign(math.inf, value)


class Monitor:
    def __init__(self, cfg, accelerator, model, optimizer, precision: str, order: list[str], say=print):
        self.acc, self.model, self.optimizer, self.say = accelerator, model, optimizer, say
        self.enabled, self.halting = cfg.health_checks, cfg.on_nan == "halt"
        self.watch = Watch.from_config(cfg, precision)
        self.order = {name: i for i, name in enumerate(order)}
        self.scaler = accelerator.scaler
        self.deepspeed = accelerator.distributed_type.name == "DEEPSPEED"
        # not probed (mixprec.health.coherence): a model compiled in place (its backward cannot be run again),
        # or one that needs activation checkpointing to fit (the probe's forward keeps every activation), or fp16
        # on a CPU (the prepared model's forward runs fp16 autocast whatever the probe asks, and there its per-row
        # backward passes took minutes: cnn-fp16 of benchmarks/diagnosis.py, Intel Xeon with AVX512-FP16)
        self.unprobed = cfg.compile or cfg.gradient_checkpointing or cfg.activation_checkpointing or \
            (precision == "fp16" and accelerator.device.type == "cpu")
        dtype = accumulation_dtype(accelerator.device)
        self.dtype, self.zero = dtype, torch.zeros((), dtype=dtype, device=accelerator.device)
        self.step_loss = self.zero  # never written into: add_loss replaces it
        self.window_loss = torch.zeros((), dtype=dtype, device=accelerator.device)
        self.window_read = 0.0  # the window's step losses read by allows_step, summed on the host (float64)
        self.window_batches = self.micro_batches = 0
        self.read = None  # (loss, grad norm) of this step, once allows_step has read them
        self.batches: list[dict] = []  # the step's micro-batches (references only), for an event's inspection
        self.step_lr, self.inspected = None, None
        self.watch.inspect = self._inspect
        self.skipped_steps, self.device_skips = 0, torch.zeros((), device=accelerator.device)
        self.bad, self.modules, self.grad_norm, self.step = False, [], None, 0
        self.halt_handler = None  # called with the event before Halted is raised (the run's record)
        self.label_batches = None  # a callable: training batches in a fixed order, for the label probe
        self.mover = None  # --fp32_modules auto under fp16 (mixprec.precision.auto_moves.Mover; set by the run)
        self.moved: Event | None = None  # this step's move, reported in place of its NaN loss
        if self.enabled:
            say(f"health checks: {self.watch.describe()}")

    # the loop's calls ---------------------------------------------------------------------------------------

    def add_loss(self, loss: torch.Tensor) -> None:
        loss = loss.detach()
        if self.micro_batches == 0:
            self.step_loss = loss  # kept, never written into
        elif self.micro_batches == 1:
            self.step_loss = self.step_loss.to(self.dtype) + loss  # a new tensor: the sum in float64
        else:
            self.step_loss += loss
        self.micro_batches += 1

    def allows_step(self, grad_norm) -> bool:
        norm = grad_norm if torch.is_tensor(grad_norm) else torch.tensor(
            math.nan if grad_norm is None else float(grad_norm), device=self.acc.device)
        self.grad_norm = norm.detach() if norm.requires_grad else norm  # clip_grad_norm_'s needs no detach
        if not self.enabled:
            if self.scaler is not None:
                self.device_skips += ~torch.isfinite(self.grad_norm)
            return True
        self.step_lr = self.optimizer.param_groups[0]["lr"]  # before the schedule moves it on
        loss, norm = map(_float32, self._read())
        self.bad = not (math.isfinite(loss) and math.isfinite(norm))
        self.modules = self._nonfinite_modules() if self.bad else []
        if self.bad and self.halting and (self.watch.precision != "fp16" or not math.isfinite(loss)):
            self._record_step(skipped=True, scale=None)  # the watch halts on it: raises Halted
        return not self.bad or self.scaler is not None or self.deepspeed

    def step_done(self) -> None:
        if self.deepspeed:  # DeepSpeed stepped inside backward, skipping a step with inf/NaN gradients
            skipped = self.acc.optimizer_step_was_skipped
        else:
            skipped = self.bad and (self.enabled or self.scaler is not None)
        scale = self.scaler.get_scale() if self.bad and self.scaler is not None else None  # bad steps only
        if skipped and self.mover is not None and self.read is not None and not math.isfinite(self.read[1]):
            # the GradScaler skipped it (the norm of the all-reduced gradients: every process is here)
            self.moved = self.mover(unwrap(self.acc, self.model), self.batches, self.step + 1)
        self._record_step(skipped, scale)

    def window(self) -> dict:
        """At a logging step: {'loss', 'grad_norm', 'skipped_steps'} over the window; then a new window."""
        self._fold_window_read()
        if self.acc.num_processes > 1:
            self.window_loss = self.acc.reduce(self.window_loss, "mean")
        values = torch.stack([self.window_loss.float(), self.grad_norm.float(), self.device_skips.float()]).tolist()
        out = {"loss": values[0] / max(1, self.window_batches), "grad_norm": values[1],
               "skipped_steps": self.skipped_steps + int(values[2])}
        self.window_loss.zero_()
        self.window_batches = 0
        return out

    # the window's steps ---------------------------------------------------------------------------------------

    def _read(self) -> tuple[float, float]:
        """The step's summed loss and gradient norm, read from the device in one go (stack promotes the dtypes)."""
        self.read = tuple(torch.stack([self.step_loss, self.grad_norm]).tolist())
        return self.read

    def _record_step(self, skipped: bool, scale: float | None) -> None:
        self.step += 1
        self.skipped_steps += int(skipped)
        if self.read is None and self.enabled and self.micro_batches and self.grad_norm is not None:
            self._read()
        if self.read is not None and self.dtype == torch.float64:  # on the host: the device's float64 additions
            self.window_read += self.read[0]
        elif self.micro_batches:  # (MPS sums in float32: on the device)
            self.window_loss += self.step_loss
        self.window_batches += self.micro_batches
        observed = None
        if self.enabled and self.read is not None:
            loss, norm = self.read
            observed = (self.step, _float32(loss / max(1, self.micro_batches)), _float32(norm), skipped,
                        self.modules, scale)
        self.step_loss, self.micro_batches, self.bad, self.modules, self.read = self.zero, 0, False, [], None
        if observed is not None:
            self._observe(*observed)
            self._probe_labels()
        self.batches, self.inspected = [], None

    def see(self, batch: dict) -> None:
        """A micro-batch of this step (a reference: nothing is computed on it unless an event needs a cause)."""
        if self.enabled:
            self.batches.append(batch)

    def _fold_window_read(self) -> None:
        """The losses summed on the host join the device's sum (before a reduce over processes or a save)."""
        if self.window_read:
            self.window_loss += self.window_read
        self.window_read = 0.0

    def _observe(self, step: int, loss: float, norm: float, skipped: bool, modules: list[str], scale) -> None:
        """Feed the watch this step's values and report its events now; halt on a halting one."""
        lr = self.step_lr if self.step_lr is not None else self.optimizer.param_groups[0]["lr"]
        events = self.watch.observe(step, loss=loss, grad_norm=norm, nonfinite_loss=not math.isfinite(loss),
                                    skipped=skipped, scale=scale, lr=lr, modules=modules)
        if self.moved is not None:  # its cause is fixed already: the move says what happened, not the NaN's advice
            self.moved.lr, self.moved.loss_scale = lr, scale
            events = [self.moved, *(e for e in events if e.event not in ("nan_loss", "nonfinite_grad"))]
            self.moved = None
        for event in events:
            self._report(event)
        if self.watch.halt is not None:
            self._halt(self.watch.halt)

    def _probe_labels(self) -> None:
        """After the first step of a classification run: do the labels steer the gradients
        (mixprec.health.coherence)? On the training batches `label_batches` gives (set by the training run); one
        process only, not under DeepSpeed or FSDP (each process would judge its own rows)."""
        if not self.watch.wants_labels():
            return
        if self.label_batches is None or self.acc.num_processes > 1 or self.deepspeed or self.unprobed or \
                self.acc.distributed_type.name == "FSDP" or not all(coherence.classification(b) for b in self.batches):
            self.watch.probe_samples = 0  # language models (labels per token), several processes, ...: not probed
            return
        found = coherence.label_ratio(unwrap(self.acc, self.model), self.label_batches(), self.watch.probe_samples,
                                      advice.COHERENCE_FLOOR)
        if found is None:  # non-finite values: not judged
            self.watch.probe_samples = 0
            return
        for event in self.watch.observe_labels(self.step, *found):
            self._report(event)

    def _inspect(self, unscaled: bool = False) -> dict:
        """What the step's micro-batches and model show (once per step, on event steps only); `unscaled`: also
        fp16's gradients at loss scale 1 (mixprec.health.causes.unscaled_fp16)."""
        if self.deepspeed or self.acc.distributed_type.name == "FSDP":
            return {}  # their forward passes gather sharded weights: collectives no single process may start alone
        if unscaled:
            found = self._inspect()
            if "unscaled" not in found:
                found["unscaled"] = causes.unscaled_fp16(unwrap(self.acc, self.model), self.batches, self.order)
            return found
        if self.inspected is None:
            raw = unwrap(self.acc, self.model)
            self.inspected = causes.inspect(raw, self.batches, self.watch.precision == "fp16")
            if self.scaler is not None:
                self.inspected["scale"] = self.scaler.get_scale()
        return self.inspected

    def _report(self, event: Event) -> None:
        self.on_event(event)
        if event is not self.watch.halt:  # that one goes to stderr
            self.say(f"[health] step {event.step}: {event.event}: {event.diagnosis}")

    def on_event(self, event: Event) -> None:  # the run's record (set by the training run)
        pass

    def _halt(self, event: Event) -> None:
        if self.halt_handler is not None:
            self.halt_handler(event)
        raise Halted(event.diagnosis)

    def _nonfinite_modules(self) -> list[str]:
        """Modules whose parameters' gradients hold inf/NaN, earliest in the forward pass first."""
        raw = unwrap(self.acc, self.model)
        found = {name.rpartition(".")[0] or name for name, p in raw.named_parameters()
                 if p.grad is not None and not bool(torch.isfinite(p.grad).all())}
        names = sorted(found, key=lambda n: self.order.get(n, len(self.order)))
        if not bool(torch.isfinite(self.step_loss).all()):
            names = ["loss", *names]
        return names

    # checkpoints --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a checkpoint keeps, so that a resumed run logs and reports what an uninterrupted one would: the
        watch, the skipped steps, and the open logging window (its loss summed per process, averaged over them)."""
        self._fold_window_read()
        window = self.acc.reduce(self.window_loss, "mean") if self.acc.num_processes > 1 else self.window_loss
        return {"watch": self.watch.state_dict(), "skipped_steps": self.skipped_steps + int(self.device_skips.item()),
                "window_loss_sum": window.item(), "window_batches": self.window_batches}

    def load_state_dict(self, state: dict, step: int, batches_scale: float = 1.0) -> None:
        """`batches_scale`: micro-batches per step now / then, when the global batch is split differently."""
        self.watch.load_state_dict(state.get("watch", {}))
        self.skipped_steps, self.step = state.get("skipped_steps", 0), step
        self.window_loss.fill_(state.get("window_loss_sum", 0.0) * batches_scale)
        self.window_read = 0.0
        self.window_batches = round(state.get("window_batches", 0) * batches_scale)
