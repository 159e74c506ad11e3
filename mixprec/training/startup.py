"""Starting a training run, in the order that keeps the run folder safe:

1. settings (already parsed), precision and hardware (the Accelerator): nothing is written;
2. the run folder, read only (`rundir.inspect`): a file, not writable, another run's, in use; and where the
   trackers of --report_to write (`tracking.check_folder`: the packages and W&B's settings were checked in 1);
3. the data (types, label range, emptiness), the model, the plan (steps, epochs), and on resume the
   checkpoint's integrity and the resume contract (`mixprec.resume`);
4. only then the run folder is opened: locked, an old run removed if asked, config.yaml written;
5. start-up measurements (FLOPs, peak FLOP/s, the forward order of modules), which leave the training random
   state untouched; optimizer, schedule, `accelerator.prepare`, the checkpoint loaded; the banner.
A resume of a run that has already finished says so and touches nothing (`Finished`), but draws a metrics.png
the disk refused at the end (missing, or older than summary.json). A resume of the final checkpoint without its
summary.json (the disk refused it, or the process ended, after that checkpoint) trains no step and writes the end
again (`Run.finish`).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import set_seed

from .. import (checkpointing, compat, config, data, distributed, hardware, health, master_weights, metrics, models,
                optim, precision, preflight, resume, rundir, sources, speed, tracking)
from ..lost_updates import LostUpdates
from ..models import hf_export, hf_flags, lora
from ..precision import policy
from ..data.batches import EvalBatches, Layout, TrainBatches
from ..errors import UsageError
from ..preemption import Preemption
from .plan import Plan
from .run import Run
from ..unwrap import unwrap


class Finished:
    """A resume of a finished run: nothing to train, nothing written (but a metrics.png the disk refused); its
    summary.json as it is."""

    accelerator = model = optimizer = scheduler = None  # no training step runs

    def __init__(self, out: Path, step: int, echo, main: bool = True):
        self.out, self.step, self.echo, self.main = out, step, echo, main

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def batches(self):
        return iter(())

    def finish(self) -> dict:
        path = self.out / "summary.json"
        self.echo(f"the run in {self.out} finished at step {self.step}: nothing to train (raise --max_steps or "
                  f"--num_epochs to train further); {path.name} is left as it is")
        png = self.out / "metrics.png"
        if self.main and (not png.exists() or png.stat().st_mtime < path.stat().st_mtime):  # refused at the end
            tracking.draw(self.out)
        return json.loads(path.read_text())


def start(cfg):
    """Everything up to the first training step (see the module docstring). Returns a `Run` or `Finished`."""
    accelerator, prec = precision.build_accelerator(cfg, **tracking.accelerator_kwargs(cfg))
    hf_flags.apply(cfg)  # --model_name_or_path: --model hf_causal_lm or hf_classifier and its settings
    speed.check(cfg, accelerator.device)
    master_weights.check(cfg, prec)
    lora.check_engine(cfg, prec, distributed.engine_of(accelerator))  # --use_peft: 16-bit autocast, no ZeRO-3
    if prec.effective == "fp16":
        preflight.grad_scaler(cfg.init_scale, cfg.growth_interval)  # built and stepped once, in memory
    echo = distributed.main_print(accelerator)
    out = Path(cfg.output_dir) if cfg.output_dir else default_output_dir(cfg)
    sources.check_output(cfg, out)  # a model, tokenizer or data folder the run reads is never written
    resume_path, damaged = rundir.inspect(cfg, out)
    tracking.check_folder(cfg, out)  # --report_to: a file or a broken link where a tracker's folder goes
    if cfg.resume_from_checkpoint == "latest" and resume_path is None:
        echo(f"resume: no checkpoint in {out / 'checkpoints'}, starting from step 0")
    fingerprint = sources.fingerprint(cfg)  # what the model's files hold
    state = checkpointing.load_state(resume_path) if resume_path is not None else None
    if state is not None:  # changed model files: refused before anything is loaded
        sources.check_unchanged(state.settings.get("sources"), fingerprint, resume_path)
    settings, changes, refused = _contract(cfg, accelerator, prec, resume_path, state, fingerprint)
    if state is not None and refused is None and _finished(cfg, accelerator, out, resume_path, state):
        return Finished(out, state.step, echo, accelerator.is_main_process)  # known before any model loads

    set_seed(cfg.seed)  # the same initial weights on every process
    with accelerator.main_process_first():
        bundle = data.build(cfg)
    if cfg.model.startswith("hf_"):  # transformers models: sized from their config (from_pretrained refuses meta)
        preflight.hf_model_memory(cfg.model, cfg.model_args, accelerator.device)
    else:
        preflight.model_memory(cfg.model, bundle.info, cfg.model_args, accelerator.device)  # before allocating
    model = lora.apply(cfg, models.build(cfg.model, bundle.info, cfg.model_args), prec)  # --use_peft: adapters
    hf_export.keep_tokenizer(cfg, model)  # the export writes the tokenizer this run used
    speed.check_model(cfg, model)  # --gradient_checkpointing: the architecture has it, or a UsageError
    prec.fp32_modules = policy.apply(cfg, model, accelerator, prec)  # --fp32_modules: matched, or a UsageError
    layout = Layout(cfg.batch_size, cfg.gradient_accumulation_steps, accelerator.process_index,
                    accelerator.num_processes)
    train = TrainBatches(bundle.train, layout, cfg.seed, accelerator.device, cfg.num_workers,
                         pin_memory=accelerator.device.type == "cuda")
    plan = Plan.make(cfg, len(bundle.train), len(train), accelerator.num_processes)
    if plan.lr > config.MAX_LR:
        raise UsageError(f"the learning rate {plan.lr:g} (--lr {cfg.lr:g} scaled by --scale_lr) is above "
                         f"{config.MAX_LR:g}: training would diverge at once; lower --lr or raise --base_batch_size")
    preflight.optimizer(cfg, model, plan.lr, plan.schedule_steps)  # made in memory before the folder is touched
    if refused is not None:  # said after the data's and the model's own checks, which name a bad value better
        raise refused
    if resume_path is not None:
        plan.resume_from(state, cfg.gradient_accumulation_steps)
        if plan.finished and state.step == plan.total_steps and out.resolve() in resume_path.resolve().parents:
            owed = _end_owed(accelerator, out, state.step)  # not None: cut short or export refused; done again
            if owed is None:
                return Finished(out, state.step, echo, accelerator.is_main_process)
            echo(f"the run in {out} finished at step {state.step} and {owed}: writing its end now "
                 f"(--save_dtype {cfg.save_dtype}), no step trained")
        if plan.step > plan.total_steps:
            raise UsageError(f"the checkpoint {resume_path} is at step {plan.step}, past the {plan.total_steps} "
                                    f"steps asked for: raise --max_steps or --num_epochs")

    folder = rundir.RunFolder(out, accelerator)
    folder.open(cfg.overwrite_output_dir)  # from here on the run folder changes
    try:
        for line in damaged:
            echo(f"resume: {line}; using {resume_path}")
        return _prepare(cfg, accelerator, prec, model, bundle, train, layout, plan, settings, state, changes,
                        resume_path, folder, echo)
    except BaseException:
        folder.close()
        raise


def _contract(cfg, accelerator, prec, resume_path, state, fingerprint) -> tuple[dict, dict, UsageError | None]:
    """(the settings a checkpoint records, the allowed changes on resume, the refusal of the resume contract or
    None), from the settings alone: no data or model loaded (mixprec.resume)."""
    try:
        samples, lr = Plan.rate(cfg, accelerator.num_processes)
        settings = resume.trajectory(cfg, lr, samples, prec.effective, models.resolved_args(cfg.model, cfg.model_args),
                                     data.resolved_args(cfg), fingerprint)
        if state is None:
            return settings, {}, None
        changes = resume.compare(state.settings, settings, cfg.allow_config_change, resume_path)
        distributed.check_resume_engine(state.layout, distributed.engine_of(accelerator), accelerator.num_processes,
                                        resume_path)
        return settings, changes, None
    except UsageError as err:
        return {}, {}, err


def _finished(cfg, accelerator, out: Path, resume_path: Path, state) -> bool:
    """Whether the resume is of this folder's own run, finished at the checkpoint's step with nothing owed, and
    asks for no more steps: known from the checkpoint, summary.json and config.yaml alone, before the data and
    the model are loaded. False when that cannot be told without the data (--num_epochs with another batch or
    data): the later check (`plan.finished`) decides then."""
    if out.resolve() not in resume_path.resolve().parents:
        return False
    decided = [_asks_no_more(cfg, out, state, accelerator.num_processes) if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(decided)
    return bool(decided[0])


def _asks_no_more(cfg, out: Path, state, world: int) -> bool:
    if _owed(out, state.step) is not None:
        return False
    try:
        import yaml

        before = (yaml.safe_load((out / "config.yaml").read_text()) or {}).get("config") or {}
    except (OSError, ValueError, AttributeError):
        return False
    if cfg.max_steps:
        return cfg.max_steps == state.step
    same = ("max_steps", "num_epochs", "batch_size", "gradient_accumulation_steps", "train_file", "dataset",
            "dataset_args", "dataset_name", "dataset_config")
    now = config.to_dict(cfg)
    return all(before.get(k) == now.get(k) for k in same) and \
        state.layout.get("world_size") == world


def _end_owed(accelerator, out: Path, step: int) -> str | None:
    """`_owed` as the main process finds it, on every process (one decision: the others follow it)."""
    owed = [_owed(out, step) if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(owed)
    return owed[0]


def _owed(out: Path, step: int) -> str | None:
    """What the end of the run in `out`, finished at `step`, still owes, in words (None: nothing): summary.json
    missing, not a completed run's (a halted job's, an end cut short by a full disk) or an earlier step's, or its
    export refused (mixprec.models.hf_export.refused). A later step's end (the run was extended since, and this is
    an older checkpoint) is left as it is."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    if not isinstance(summary, dict) or summary.get("status") != "completed" or \
            not isinstance(summary.get("steps"), int) or summary["steps"] < step:
        return "its summary.json is not this step's"
    return "its export was refused" if summary["steps"] == step and hf_export.refused(summary) else None


def default_output_dir(cfg) -> Path:
    """runs/<model>-<dataset>-<date>-<time>, the same on every process (the main one picks it)."""
    from accelerate.utils import broadcast_object_list

    stamp = [time.strftime("%Y%m%d-%H%M%S")]
    broadcast_object_list(stamp)
    return Path("runs") / f"{cfg.model}-{cfg.dataset}-{stamp[0]}"


def _measure(cfg, accelerator, prec, model, bundle) -> tuple[dict, dict, list[str], tuple | None]:
    """FLOPs per sample, this process's CPU threads (one for a model too small to split: mixprec.threads), the
    device's peak FLOP/s with those threads, and the modules' forward order, without touching the random
    state that training uses (dropout)."""
    devices = [accelerator.device.index or 0] if accelerator.device.type == "cuda" else []
    example = {k: torch.as_tensor(v)[None] for k, v in bundle.train[0].items()}
    threads = None
    with torch.random.fork_rng(devices=devices):
        cost = metrics.training_cost(model, example["inputs"][0], bundle.info)
        if accelerator.device.type == "cpu":
            threads = hardware.set_cpu_threads(cfg.cpu_threads, cost["flops_per_sample"] * cfg.batch_size / 1e9)
        order = health.forward_order(model, example)
        peak = metrics.peak_flops(accelerator.device, prec.effective, cfg.tf32, cfg.peak_flops)
    return cost, peak, order, threads


def _prepare(cfg, accelerator, prec, model, bundle, train, layout, plan, settings, state, changes, resume_path,
             folder, echo) -> Run:
    num_parameters = sum(p.numel() for p in model.parameters())  # before ZeRO-3 / FSDP shard them
    cost, peak, order, threads = _measure(cfg, accelerator, prec, model, bundle)
    speed_options = speed.apply(cfg, model, accelerator.device)
    model = master_weights.prepare_model(cfg, model, speed_options)  # bf16: after the fp32 measurements
    lora.freeze_base(cfg, model, prec)  # --use_peft: the frozen base in the autocast dtype, after them too
    optimizer = master_weights.optimizer(cfg, model, plan.lr, fused=speed_options["fused_adamw"])
    lost_updates = LostUpdates(optimizer, cfg, plan.total_steps)
    lr_factor = optim.schedule(cfg.warmup_steps, plan.schedule_steps, cfg.lr_schedule, cfg.min_lr_ratio)
    scheduler = optim.scheduler(optimizer, cfg.warmup_steps, plan.schedule_steps, cfg.lr_schedule, cfg.min_lr_ratio)
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    accelerator.register_for_checkpointing(scheduler)
    distributed.like_ddp(accelerator, model)
    world = accelerator.num_processes
    if state is None:
        set_seed((cfg.seed + accelerator.process_index) % 2**32)  # dropout masks differ between processes
    else:
        accelerator.load_state(str(resume_path))
        compat.restart_accumulation(accelerator)  # checkpoints are taken at the end of accumulation windows
        resume.apply(changes, optimizer, scheduler, accelerator.scaler, lr_factor)
        if state.layout.get("world_size", world) != world:  # the saved random states are per process
            set_seed((cfg.seed + accelerator.process_index + 1_000_003 * plan.step) % 2**32)

    info = {**precision.describe(accelerator, prec, model, cfg.eval_precision, optimizer),
            **master_weights.describe(cfg, prec.engine)}
    if threads:
        info["cpu_threads"] = {"threads": threads[0], "why": threads[1]}
    derived = {"output_dir": str(folder.out), "lr": plan.lr, "samples_per_step": plan.samples_per_step,
               "total_steps": plan.total_steps, "schedule_steps": plan.schedule_steps,
               "steps_per_epoch": plan.steps_per_epoch, "num_epochs": plan.num_epochs,
               "num_parameters": num_parameters, "train_samples": len(bundle.train),
               "val_samples": len(bundle.validation), "data": train.describe(), **cost, **peak}
    extra = [f"threads        {threads[0]} per process ({threads[1]})"] if threads else []
    raw = unwrap(accelerator, model)
    if hasattr(raw, "weights"):  # transformers models: the checkpoint's stored dtype and the trained one
        info["hf_weights"], extra = raw.weights(), [*extra, raw.describe()]
    echo(precision.banner(info, [*extra, metrics.describe_peak(cost, peak), speed.describe(speed_options),
                                 f"data           {train.describe()}"]))
    if master_weights.warning(cfg):
        echo(master_weights.warning(cfg))
    echo(f"training {cfg.model} on {cfg.dataset}: {num_parameters:,} parameters, {plan.total_steps} steps of "
         f"{plan.samples_per_step} samples, lr {plan.lr:g}, output {folder.out}")
    entry = _history_entry(cfg, state, changes, plan, resume_path, echo)
    run_info = {"config": config.to_dict(cfg), "effective": info, "derived": derived, "speed": speed_options,
                "environment": tracking.environment()}
    folder.write_config(run_info, entry)
    recorder = tracking.Recorder(folder.out, accelerator, cfg, run_info, resume_from=resume_path,
                                 state=state or checkpointing.TrainerState())
    monitor = health.Monitor(cfg, accelerator, model, optimizer, prec.effective, order, say=echo)
    if state is not None:
        monitor.load_state_dict(state.extra.get("health", {}), state.step, plan.batches_scale)
        lost_updates.load_state_dict(state.extra.get("lost_updates", {}))
    lost_updates.after(plan.step)
    return Run(cfg=cfg, accelerator=accelerator, prec=prec, model=model, optimizer=optimizer, scheduler=scheduler,
               lr_factor=lr_factor, plan=plan, bundle=bundle, train_batches=train,
               val_batches=EvalBatches(bundle.validation, cfg.eval_batch_size or cfg.batch_size,
                                       accelerator.process_index, world, accelerator.device),
               layout={"batch_size": cfg.batch_size, "accumulation": cfg.gradient_accumulation_steps,
                       "world_size": world, "samples_per_step": plan.samples_per_step,
                       "engine": distributed.engine_of(accelerator)},
               settings=settings, info=info, health=monitor, recorder=recorder, folder=folder,
               preemption=Preemption(accelerator, folder.out),
               throughput=metrics.Throughput(cost, peak, world, accelerator.device), lost_updates=lost_updates,
               samples_per_batch=cfg.batch_size * world)


def _history_entry(cfg, state, changes, plan, resume_path, echo) -> dict:
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
