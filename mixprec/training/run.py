"""A training run once everything is checked and the run folder is open: what `recipes/train.py` hands the
bookkeeping to, so that its loop shows only the training step.

- `batches()`: this process's micro-batches, epoch after epoch, from where a resume left off;
- `add_loss(loss)` / `health.allows_step(grad_norm)`: the health checks (mixprec.health);
- `step_end()` after each optimizer step: the progress bar, the log every --log_every steps, evaluation
  after each epoch (and every --eval_steps), a checkpoint every --checkpointing_steps and at the end, and a
  stop requested by a signal (checkpoint, then exit code 75). True when the run is over;
- `finish()`: the final weights (model.safetensors), a text sample for language models, summary.json.
A `Run` is a context manager: on leaving it, however, the signal handlers are restored and the run folder's
lock is released.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from tqdm.auto import tqdm

from ..run_folder import checkpointing
from .. import compat, metrics
from . import generate
from ..run_folder.checkpointing import TrainerState
from .validation import evaluate
from ..models import hf_export

if TYPE_CHECKING:
    from accelerate import Accelerator

    from ..config import TrainConfig
    from ..data import DataBundle
    from ..data.batches import EvalBatches, TrainBatches
    from ..health import Monitor
    from ..precision.lost_updates import LostUpdates
    from ..precision import Precision
    from ..run_folder.preemption import Preemption
    from ..run_folder.rundir import RunFolder
    from ..tracking import Recorder
    from .plan import Plan


@dataclass
class Run:
    """What `startup.start` built, and the run's position. The loop reads `accelerator`, `model`, `optimizer`,
    `scheduler`, `health` and `max_grad_norm`; the rest is the bookkeeping's."""

    cfg: TrainConfig
    accelerator: Accelerator
    prec: Precision
    model: object  # the prepared model (torch.nn.Module, DDP, or DeepSpeed's engine)
    optimizer: object  # Accelerate's AcceleratedOptimizer
    scheduler: object  # torch's LambdaLR, stepped once per optimizer step
    lr_factor: Callable[[int], float]  # the schedule's multiplier of the peak rate at a 0-based step
    plan: Plan
    bundle: DataBundle
    train_batches: TrainBatches
    val_batches: EvalBatches
    layout: dict  # batch size, accumulation, world size, engine: kept in each checkpoint
    settings: dict  # what the resume contract compares
    info: dict  # the banner's facts, as in config.yaml
    health: Monitor
    recorder: Recorder
    folder: RunFolder
    preemption: Preemption
    throughput: metrics.Throughput
    lost_updates: LostUpdates  # the share of updates that round away, on logging steps
    samples_per_batch: int
    step: int = field(init=False)
    skipped_steps: int = field(init=False)
    epoch: int = field(init=False, default=0)
    done: int = field(init=False, default=0)  # micro-batches of this epoch done
    last_eval: dict | None = field(init=False, default=None)
    last_save: Path | None = field(init=False, default=None)
    last_loss: float | None = field(init=False, default=None)
    max_grad_norm: float = field(init=False)
    started: float = field(init=False)
    timeline: dict = field(init=False)  # the wall-time split (summary.json's `timeline`): epoch seconds and sums
    progress: tqdm = field(init=False, repr=False)
    say: Callable[[str], None] = field(init=False, repr=False)

    def __post_init__(self):
        self.step, self.skipped_steps = self.plan.step, self.health.skipped_steps
        self.max_grad_norm = self.cfg.max_grad_norm or float("inf")  # inf: measure the norm, clip nothing
        self.started = time.perf_counter()
        self.timeline = {"process_start": _process_start(), "first_batch": None, "finish": None,
                         "evaluation_s": 0.0, "checkpoints_s": 0.0}
        self.say = tqdm.write if self.accelerator.is_main_process else (lambda text: None)  # above the bar
        self.health.say = self.say
        self.health.on_event = lambda event: self.recorder.log(event.record())
        self.health.halt_handler = self._halted
        self.health.watch.classes = self.bundle.info.get("num_classes") or self.bundle.info.get("vocab_size")
        self.health.label_batches = lambda: self.train_batches.epoch(0)  # its seeded order: no random state used
        if self.prec.fp32_plan and self.prec.effective == "fp16":  # --fp32_modules auto: moves during training
            from ..precision import auto_moves, policy

            self.health.mover = auto_moves.Mover(self.prec.fp32_plan, self.settings, self.accelerator,
                                                 policy.keep_fp32, self._fp32_plan_moved)

    @property
    def out(self) -> Path:
        return self.folder.out

    def __enter__(self) -> "Run":
        self.preemption.__enter__()  # SIGTERM, SIGHUP, SIGUSR1, SIGINT: checkpoint and stop
        main = self.accelerator.is_main_process  # the bar after: on the streams preemption keeps for a terminal
        self.progress = tqdm(total=self.plan.total_steps, initial=self.step, desc="train", dynamic_ncols=True,
                             disable=not (main and sys.stderr.isatty()))  # log files get the lines below
        return self

    def __exit__(self, *exc) -> None:
        self.progress.close()
        self.recorder.close()  # the helper drawing metrics.png ends with the run
        self.preemption.__exit__(*exc)
        self.folder.close()

    # the loop's calls ---------------------------------------------------------------------------------------

    def batches(self):
        epoch, start = self.plan.epoch, self.plan.batches_done
        while self.step < self.plan.total_steps:
            self.epoch, self.done = epoch, start
            for batch in self.throughput.timed(self.train_batches.epoch(epoch, start)):
                if self.timeline["first_batch"] is None:
                    self.timeline["first_batch"] = time.time()
                self.done += 1
                self.health.see(batch)  # a reference, for a health event's inspection of the step
                yield batch
            epoch, start = epoch + 1, 0

    def add_loss(self, loss) -> None:
        self.health.add_loss(loss)
        self.throughput.add(self.samples_per_batch, step=self.accelerator.sync_gradients)

    def step_end(self) -> bool:
        self.health.step_done()
        self.step += 1
        self.lost_updates.after(self.step)  # armed when the next step logs
        self.progress.update(1)
        stop = self.preemption.requested(self.step)
        end_of_epoch = self.done == len(self.train_batches)
        if self.step % self.cfg.log_every == 0 or self.step == self.plan.total_steps:
            self._log()
        if end_of_epoch or self.step == self.plan.total_steps or (self.cfg.eval_steps and
                                                                  self.step % self.cfg.eval_steps == 0):
            self._evaluate()
        if (self.cfg.checkpointing_steps and self.step % self.cfg.checkpointing_steps == 0) or \
                self.step == self.plan.total_steps or stop:
            self._save(end_of_epoch)
        if stop and self.step < self.plan.total_steps:
            self.progress.close()
            self.preemption.leave(self.step, self.last_save)  # exits with code 75
        return self.step >= self.plan.total_steps

    # the step's bookkeeping ----------------------------------------------------------------------------------

    def _lr_of_last_step(self) -> float:
        return self.plan.lr * self.lr_factor(self.step - 1)

    def _position(self) -> float:
        return round(self.epoch + self.done / len(self.train_batches), 4)

    def _log(self) -> None:
        window = self.health.window()
        record = {"step": self.step, "epoch": self._position(), "loss": window["loss"],
                  "lr": self._lr_of_last_step(), "grad_norm": window["grad_norm"],
                  "skipped_steps": window["skipped_steps"], **self.throughput.report(),
                  **self.lost_updates.read(self.step, self.health._report)}
        if self.accelerator.scaler is not None:
            record["loss_scale"] = self.accelerator.scaler.get_scale()
        self.recorder.log(record)
        self.last_loss, self.skipped_steps = window["loss"], window["skipped_steps"]
        self.progress.set_postfix(loss=f"{window['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                  **({"scale": f"{record['loss_scale']:g}"} if "loss_scale" in record else {}))
        self.say(f"Epoch {self.epoch + 1}, Batch {self.done}, Loss: {window['loss']:.4f}")

    def _evaluate(self) -> None:
        began = time.perf_counter()
        self.last_eval = {"step": self.step, "epoch": self._position(),
                          **evaluate(self.model, self.val_batches, self.accelerator, self.cfg.eval_precision == "fp32")}
        if (self.recorder.kept("val_loss") or {}).get("step") != self.step:  # a resume at the end has it already
            self.recorder.log(self.last_eval)
        self.say(f"Epoch {self.epoch + 1}, step {self.step}: val_loss {self.last_eval['val_loss']:.4f}, "
                 f"val_accuracy {self.last_eval['val_accuracy']:.4f}")
        self.throughput.exclude_pause()
        self.timeline["evaluation_s"] += time.perf_counter() - began

    def _save(self, end_of_epoch: bool) -> None:
        began = time.perf_counter()
        epoch, done = (self.epoch + 1, 0) if end_of_epoch else (self.epoch, self.done)
        state = TrainerState(step=self.step, epoch=epoch, batches_done=done, schedule_steps=self.plan.schedule_steps,
                             layout=self.layout, settings=self.settings,
                             extra={**self.recorder.checkpoint_state(), "health": self.health.state_dict(),
                                    "lost_updates": self.lost_updates.state_dict()})
        self.last_save = checkpointing.save(self.accelerator, self.out, state, self.cfg.checkpoints_total_limit)
        self.throughput.exclude_pause()
        self.timeline["checkpoints_s"] += time.perf_counter() - began

    def _fp32_plan_moved(self, plan: dict) -> None:
        """config.yaml's effective.fp32_plan after a move (mixprec.precision.auto_moves), with a history entry."""
        last = plan["moved"][-1]["step"]
        self.folder.amend_config({"fp32_plan": plan}, {"event": "fp32_module_moved", "step": last, "modules": [
            m["name"] for m in plan["moved"] if m["step"] == last]})

    def _halted(self, event) -> None:
        """--on_nan halt: record why, point to the last good checkpoint; Halted (exit code 3) follows."""
        last, _ = checkpointing.find(self.out / "checkpoints")
        resume = (f"The last good checkpoint is {last}: fix the cause, then continue with --resume_from_checkpoint "
                  f"latest --output_dir {self.out}" if last else "No checkpoint was saved before it: fix the cause "
                  f"and start again")
        self.recorder.finish({"status": "halted", "halted_at_step": event.step, "event": event.event,
                              "diagnosis": event.diagnosis, "last_checkpoint": str(last or "")})
        if self.accelerator.is_main_process:
            self.progress.close()
            print(f"error: halted at step {event.step} ({event.event}): {event.diagnosis} {resume}.",
                  file=sys.stderr, flush=True)
        self.accelerator.end_training()

    # the end ------------------------------------------------------------------------------------------------

    def finish(self) -> dict:
        self.timeline["finish"] = time.time()
        self.progress.close()
        acc = self.accelerator
        acc.wait_for_everyone()
        acc.save_model(self.model, str(self.out), safe_serialization=True)
        if acc.is_main_process:
            compat.umask_modes(self.out)  # model.safetensors (or its shards): readable as the umask says
        if self.last_eval is None:
            self._evaluate()
        generate.write_sample(self.model, self.bundle, self.cfg, acc, self.out, self.cfg.eval_precision == "fp32")
        if self.last_loss is None:  # a resume of the final checkpoint: no step trained in this job
            self.last_loss = (self.recorder.kept("loss") or {}).get("loss")
        summary = {"status": "completed", "steps": self.step, "train_loss": self.last_loss,
                   "val_loss": self.last_eval["val_loss"], "val_accuracy": self.last_eval["val_accuracy"],
                   "skipped_steps": self.skipped_steps, "world_size": acc.num_processes,
                   "effective_precision": self.prec.effective, "autocast_dtype": self.info["autocast_dtype"],
                   "grad_scaler": acc.scaler is not None, "master_weight_dtype": self.info["master_weight_dtype"],
                   "wall_time_s": time.perf_counter() - self.started, **self.throughput.summary(),
                   "last_checkpoint": str(self.last_save or ""), "timeline": self.timeline}
        if (self.prec.fp32_plan or {}).get("moved"):  # --fp32_modules auto under fp16: modules moved while training
            summary["fp32_modules_moved"] = self.prec.fp32_plan["moved"]
        summary.update(hf_export.export(acc, self.model, self.cfg, self.out))  # transformers models only
        self.recorder.finish(summary)
        if acc.is_main_process:
            print(f"done: {self.step} steps in {summary['wall_time_s']:.1f}s, val_loss {summary['val_loss']:.4f}, "
                  f"val_accuracy {summary['val_accuracy']:.4f} ({self.prec.effective}); outputs in {self.out}\n"
                  f"{metrics.describe_summary(summary)}", flush=True)
        acc.end_training()
        return summary


def _process_start() -> float | None:
    """When this process started (epoch seconds, to 10 ms), for the wall-time split; None where unknown."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001  a figure of the report, never a reason to stop
        return None
