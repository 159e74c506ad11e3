"""A run checked and built, its folder open: `Start`, what recipes/train.py hands to `accelerator.prepare`
(`model`, `optimizer`) and then to `begin`, which makes the `Run`:

- the scheduler is registered for checkpoints (`accelerator.register_for_checkpointing`), not prepared: it is
  torch's LambdaLR, stepped by the loop once per optimizer step (skipped steps too), the same on every engine;
- a resume loads the checkpoint (`accelerator.load_state`), restarts Accelerate's accumulation count and applies
  the allowed changes (mixprec.run_folder.resume); a new run seeds each process apart (dropout masks differ);
- the banner says what really runs, and config.yaml records it with this start's history entry.
A `Start` is a context manager: on leaving it the `Run`'s signal handlers are restored and the run folder's lock
is released (the folder alone, when `begin` was not reached).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from accelerate.utils import set_seed

from ..run_folder import checkpointing, resume
from .. import compat, config, health, metrics, optim, precision, tracking
from ..devices import distributed
from ..precision import master_weights
from . import speed
from ..data.batches import EvalBatches
from ..run_folder.preemption import Preemption
from ..unwrap import unwrap
from .run import Run

if TYPE_CHECKING:
    from accelerate import Accelerator

    from ..data import DataBundle
    from ..data.batches import TrainBatches
    from ..precision.lost_updates import LostUpdates
    from ..run_folder.rundir import RunFolder
    from .plan import Plan


@dataclass
class Start:
    """What mixprec.training.startup checked and built (the model, optimizer and scheduler before
    `accelerator.prepare`), and what `begin` needs after it."""

    finished = False  # a class attribute: `Finished` says True
    cfg: config.TrainConfig
    accelerator: Accelerator
    prec: precision.Precision
    model: object  # the model as built (fp32, or --master_weights bf16), not yet prepared
    bundle: DataBundle
    train: TrainBatches
    plan: Plan
    settings: dict  # what the resume contract compares
    state: checkpointing.TrainerState | None  # the checkpoint's, on resume
    changes: dict  # the settings a resume changes (--allow_config_change)
    resume_path: Path | None
    folder: RunFolder
    echo: Callable[[str], None]
    optimizer: object = None
    scheduler: object = None  # torch's LambdaLR
    lr_factor: Callable[[int], float] | None = None
    lost_updates: LostUpdates | None = None
    num_parameters: int = 0
    cost: dict = field(default_factory=dict)  # FLOPs per sample (mixprec.metrics)
    peak: dict = field(default_factory=dict)  # the device's peak FLOP/s
    order: list = field(default_factory=list)  # the modules' forward order (mixprec.health)
    threads: tuple | None = None  # CPU threads and why
    plotter: object = None  # metrics.png's helper process (main process), handed to the run's Recorder
    speed_options: dict = field(default_factory=dict)
    run: Run | None = None

    def __enter__(self) -> "Start":
        return self

    def __exit__(self, *exc) -> None:
        if self.run is not None:
            self.run.__exit__(*exc)
        else:
            if self.plotter is not None:
                self.plotter.close()
            self.folder.close()

    def begin(self, model, optimizer) -> Run:
        """The `Run` of the prepared `model` and `optimizer` (see the module docstring), entered: its signal
        handlers are installed and its progress bar drawn."""
        cfg, accelerator, plan, state = self.cfg, self.accelerator, self.plan, self.state
        model.train()
        accelerator.register_for_checkpointing(self.scheduler)
        distributed.like_ddp(accelerator, model)
        if state is None:
            set_seed((cfg.seed + accelerator.process_index) % 2**32)  # dropout masks differ between processes
        else:
            accelerator.load_state(str(self.resume_path))
            compat.restart_accumulation(accelerator)  # checkpoints are taken at the end of accumulation windows
            resume.apply(self.changes, optimizer, self.scheduler, accelerator.scaler, self.lr_factor)
            if state.layout.get("world_size", accelerator.num_processes) != accelerator.num_processes:
                # the saved random states are per process
                set_seed((cfg.seed + accelerator.process_index + 1_000_003 * plan.step) % 2**32)
        info, run_info, entry = self._describe(model, optimizer)
        self.folder.write_config(run_info, entry)
        recorder = tracking.Recorder(self.folder.out, accelerator, cfg.tracking, run_info, resume_from=self.resume_path,
                                     state=state or checkpointing.TrainerState(), plotter=self.plotter)
        monitor = health.Monitor(cfg, accelerator, model, optimizer, self.prec.effective, self.order, say=self.echo)
        if state is not None:
            monitor.load_state_dict(state.extra.get("health", {}), state.step, plan.batches_scale)
            self.lost_updates.load_state_dict(state.extra.get("lost_updates", {}))
        self.lost_updates.after(plan.step)
        world = accelerator.num_processes
        self.run = Run(cfg=cfg, accelerator=accelerator, prec=self.prec, model=model, optimizer=optimizer,
                       scheduler=self.scheduler, lr_factor=self.lr_factor, plan=plan, bundle=self.bundle,
                       train_batches=self.train,
                       val_batches=EvalBatches(self.bundle.validation, cfg.eval_batch_size or cfg.batch_size,
                                               accelerator.process_index, world, accelerator.device),
                       layout={"batch_size": cfg.batch_size, "accumulation": cfg.gradient_accumulation_steps,
                               "world_size": world, "samples_per_step": plan.samples_per_step,
                               "engine": distributed.engine_of(accelerator),
                               **({"cpu_threads": self.threads[0]} if self.threads else {})},  # a resume reuses it
                       settings=self.settings, info=info, health=monitor, recorder=recorder, folder=self.folder,
                       preemption=Preemption(accelerator, self.folder.out),
                       throughput=metrics.Throughput(self.cost, self.peak, world, accelerator.device),
                       lost_updates=self.lost_updates, samples_per_batch=cfg.batch_size * world)
        return self.run.__enter__()

    def _describe(self, model, optimizer) -> tuple[dict, dict, dict]:
        """The banner (said), config.yaml's facts and this start's history entry."""
        cfg, accelerator, plan, prec = self.cfg, self.accelerator, self.plan, self.prec
        info = {**precision.describe(accelerator, prec, model, cfg.eval_precision, optimizer),
                **master_weights.describe(cfg.precision, prec.engine)}
        threads, cost, peak = self.threads, self.cost, self.peak
        if threads:
            info["cpu_threads"] = {"threads": threads[0], "why": threads[1]}
        derived = {"output_dir": str(self.folder.out), "lr": plan.lr, "samples_per_step": plan.samples_per_step,
                   "total_steps": plan.total_steps, "schedule_steps": plan.schedule_steps,
                   "steps_per_epoch": plan.steps_per_epoch, "num_epochs": plan.num_epochs,
                   "num_parameters": self.num_parameters, "train_samples": len(self.bundle.train),
                   "val_samples": len(self.bundle.validation), "data": self.train.describe(),
                   "validation": validation_line(self.bundle), **cost, **peak}
        if self.bundle.info.get("dropped_rows"):  # chat rows without a target token within the block
            derived["dropped_rows"] = self.bundle.info["dropped_rows"]
        extra = [f"threads        {threads[0]} per process ({threads[1]})"] if threads else []
        raw = unwrap(accelerator, model)
        if hasattr(raw, "weights"):  # transformers models: the checkpoint's stored dtype and the trained one
            info["hf_weights"], extra = raw.weights(), [*extra, raw.describe()]
        self.echo(precision.banner(info, [*extra, metrics.describe_peak(cost, peak),
                                          speed.describe(self.speed_options), f"data           {self.train.describe()}",
                                          f"validation     {derived['validation']}"]))
        if master_weights.warning(cfg.precision):
            self.echo(master_weights.warning(cfg.precision))
        self.echo(f"training {cfg.model} on {cfg.dataset}: {self.num_parameters:,} parameters, {plan.total_steps} "
                  f"steps of {plan.samples_per_step} samples, lr {plan.lr:g}, output {self.folder.out}")
        entry = _history_entry(cfg.optim, self.state, self.changes, plan, self.resume_path, self.echo)
        run_info = {"config": config.to_dict(cfg), "effective": info, "derived": derived, "speed": self.speed_options,
                    "environment": tracking.environment()}
        return info, run_info, entry


def validation_line(bundle) -> str:
    """Where validation comes from and its size: "--validation_file 'v.jsonl': 40 rows, 1,234 tokens"."""
    from ..data import validation_rows_and_tokens

    rows, tokens = validation_rows_and_tokens(bundle)
    return (f"{bundle.info['validation_from']}: {rows:,} row{'s' * (rows != 1)}"
            + (f", {tokens:,} token{'s' * (tokens != 1)}" if tokens is not None else ""))


def _history_entry(cfg: config.OptimSettings, state, changes, plan, resume_path, echo) -> dict:
    """config.yaml's history entry for this start, said on the console too."""
    if state is None:
        return {"event": "started", "step": 0, "command": " ".join(sys.argv)}
    echo(f"resumed from {resume_path} at step {plan.step} (epoch {plan.epoch}, batch {plan.batches_done})")
    changed = {name: f"{old} -> {new}" for name, (old, new) in changes.items()}
    for name, text in changed.items():
        echo(f"resume: {name} {text}, from step {plan.step + 1} on (--allow_config_change)")
    final_lr = plan.lr * optim.lr_factor(plan.schedule_steps, cfg.warmup_steps, plan.schedule_steps,
                                         cfg.lr_schedule, cfg.min_lr_ratio)
    note = resume.describe_length(plan.step, plan.total_steps, plan.schedule_steps, final_lr)
    if note:
        echo(f"resume: {note}")
    entry = {"event": "resumed", "step": plan.step, "from_checkpoint": str(resume_path), "changed": changed}
    return {**entry, "note": note} if note else entry
