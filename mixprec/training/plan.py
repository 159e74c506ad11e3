"""How long a run is and where it starts: optimizer steps, epochs, the schedule's length, the data position.

- An optimizer step takes `samples_per_step` = batch_size x gradient_accumulation_steps x processes samples;
  an epoch has as many steps as fit whole (`mixprec.data.batches` leaves out the rest of an epoch).
- `--max_steps` counts optimizer steps, applied or skipped (NaN/Inf, fp16 overflow): a run always ends at
  that step, and the learning-rate schedule, stepped on every one of them, always reaches its end there.
  Without it, `--num_epochs` x the steps of an epoch.
- A resumed run continues at the checkpoint's step and sample; its schedule keeps the length it was planned
  with (`mixprec.run_folder.resume.describe_length` says what a changed length does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import UsageError

if TYPE_CHECKING:
    from ..config.sections import OptimSettings


@dataclass
class Plan:
    samples_per_step: int
    micro_batches_per_epoch: int  # per process
    steps_per_epoch: int
    total_steps: int
    num_epochs: int
    schedule_steps: int
    lr: float
    step: int = 0  # where training starts
    epoch: int = 0
    batches_done: int = 0  # micro-batches of `epoch` done, per process
    batches_scale: float = 1.0  # micro-batches per step now / in the checkpoint's layout

    @staticmethod
    def rate(optim: OptimSettings, world_size: int) -> tuple[int, float]:
        """(samples per optimizer step, learning rate): known before the data is loaded."""
        samples = optim.batch_size * optim.gradient_accumulation_steps * world_size
        return samples, optim.lr * samples / optim.base_batch_size if optim.scale_lr else optim.lr

    @classmethod
    def make(cls, optim: OptimSettings, rows: int, micro_batches_per_epoch: int, world_size: int) -> "Plan":
        samples, lr = cls.rate(optim, world_size)
        steps_per_epoch = micro_batches_per_epoch // optim.gradient_accumulation_steps
        if steps_per_epoch == 0:
            raise UsageError(
                f"the training set has {rows:,} rows, fewer than one optimizer step of {samples:,} samples "
                f"(--batch_size {optim.batch_size} x --gradient_accumulation_steps "
                f"{optim.gradient_accumulation_steps} x {world_size} processes): lower --batch_size or "
                f"--gradient_accumulation_steps")
        total = optim.max_steps or optim.num_epochs * steps_per_epoch
        return cls(samples, micro_batches_per_epoch, steps_per_epoch, total, math.ceil(total / steps_per_epoch),
                   total, lr)

    def resume_from(self, state, accumulation: int) -> None:
        """Continue where `state` (a TrainerState) stopped. The position is kept in samples: a checkpoint of
        another split of the same global batch lands on the same sample; of another global batch (allowed by
        --allow_config_change global_batch), on the first whole step at or after it."""
        self.step, self.schedule_steps = state.step, state.schedule_steps or self.total_steps
        old = state.layout or {}
        old_accumulation = old.get("accumulation", accumulation)
        old_samples = old.get("samples_per_step", self.samples_per_step)
        steps_in_epoch = state.batches_done // old_accumulation
        new_steps = -(-steps_in_epoch * old_samples // self.samples_per_step)
        self.epoch, self.batches_done = state.epoch, new_steps * accumulation
        if self.batches_done >= self.micro_batches_per_epoch:
            self.epoch, self.batches_done = self.epoch + 1, 0
        self.batches_scale = accumulation / old_accumulation
        self.num_epochs = max(self.num_epochs, self.epoch + 1 if self.step < self.total_steps else self.epoch)

    @property
    def finished(self) -> bool:
        return self.step >= self.total_steps
