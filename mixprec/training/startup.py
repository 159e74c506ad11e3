"""Starting a training run (`start`), in the order that keeps the run folder safe:

1. settings (already parsed), precision and hardware (recipes/train.py: `precision.choose`, `Accelerator(...)`,
   `precision.make_real`): nothing is written;
2. the run folder, read only (`rundir.inspect`): a file, not writable, another run's, in use; and where the
   trackers of --report_to write (`tracking.check_folder`: the packages and W&B's settings were checked in 1);
3. the data (types, label range, emptiness), the model, the plan (steps, epochs), and on resume the
   checkpoint's integrity and the resume contract (`mixprec.run_folder.resume`);
4. only then the run folder is opened: locked, an old run removed if asked;
5. start-up measurements (FLOPs, peak FLOP/s, the forward order of modules), which leave the training random
   state untouched; the optimizer and the schedule: a `Start` (mixprec.training.prepared), which the recipe
   hands to `accelerator.prepare`, then to `Start.begin`: the checkpoint loaded, the banner, config.yaml.
A resume of a run that has already finished says so and touches nothing (`Finished`), but draws a metrics.png
the disk refused at the end (missing, or older than summary.json). A resume of the final checkpoint without its
summary.json (the disk refused it, or the process ended, after that checkpoint) trains no step and writes the end
again (`Run.finish`).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate.utils import set_seed

from ..run_folder import checkpointing, resume, rundir, sources
from .. import config, data, health, metrics, models, optim, preflight, tracking
from ..devices import distributed, hardware
from ..precision import master_weights
from . import speed
from ..precision.lost_updates import LostUpdates
from ..models import hf_export, lora
from ..precision import policy
from ..data.batches import Layout, TrainBatches
from ..errors import UsageError
from .plan import Plan
from .prepared import Start

if TYPE_CHECKING:
    from ..config.sections import DataSettings, ModelSettings, OptimSettings, SpeedSettings


class Finished:
    """A resume of a finished run: nothing to train, nothing written (but a metrics.png the disk refused); its
    summary.json as it is."""

    finished = True
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


def start(cfg, accelerator, prec) -> "Start | Finished":
    """Everything up to `accelerator.prepare` (see the module docstring), with the Accelerator recipes/train.py
    made for `prec` (mixprec.precision.choose). Returns a `Start` (the run folder open) or `Finished`."""
    speed.check(cfg.speed, cfg, accelerator.device)
    master_weights.check(cfg, prec)
    lora.check_engine(cfg.lora, cfg, prec, distributed.engine_of(accelerator))  # --use_peft: 16-bit autocast, no ZeRO-3
    if prec.effective == "fp16":
        preflight.grad_scaler(cfg.init_scale, cfg.growth_interval)  # built and stepped once, in memory
    echo = distributed.main_print(accelerator)
    out = Path(cfg.output_dir) if cfg.output_dir else default_output_dir(cfg, cfg.data)
    sources.check_output(cfg, cfg.data, out)  # a model, tokenizer or data folder the run reads is never written
    resume_path, damaged = rundir.inspect(cfg.run_folder, out)
    tracking.check_folder(cfg.tracking, out)  # --report_to: a file or a broken link where a tracker's folder goes
    if cfg.resume_from_checkpoint == "latest" and resume_path is None:
        echo(f"resume: no checkpoint in {out / 'checkpoints'}, starting from step 0")
    fingerprint = sources.fingerprint(cfg)  # what the model's files hold
    state = checkpointing.load_state(resume_path) if resume_path is not None else None
    if state is not None:  # changed model files: refused before anything is loaded
        sources.check_unchanged(state.settings.get("sources"), fingerprint, resume_path)
    settings, changes, refused = _contract(cfg, accelerator, prec, resume_path, state, fingerprint)
    if state is not None and refused is None and _finished(cfg, accelerator, out, resume_path, state):
        return Finished(out, state.step, echo, accelerator.is_main_process)  # known before any model loads

    # metrics.png's helper process (mixprec.tracking.plot_process) starts now, so that it has imported matplotlib
    # by the end of even a short run (not where matplotlib is imported already); it ends with the run, or here
    # when the start fails
    wanted = accelerator.is_main_process and tracking.PlotProcess.worth_starting()
    plotter = tracking.PlotProcess() if wanted else None
    try:
        set_seed(cfg.seed)  # the same initial weights on every process
        with accelerator.main_process_first():
            bundle = data.build(cfg)
        if cfg.model.startswith("hf_"):  # transformers models: sized from their config (from_pretrained refuses meta)
            preflight.hf_model_memory(cfg.model, cfg.model_args, accelerator.device)
        else:
            preflight.model_memory(cfg.model, bundle.info, cfg.model_args, accelerator.device)  # before allocating
        model = lora.apply(cfg.lora, models.build(cfg.model, bundle.info, cfg.model_args), prec)  # --use_peft: adapters
        hf_export.keep_tokenizer(cfg, cfg.data, model)  # the export writes the tokenizer this run used
        speed.check_model(cfg.speed, model)  # --gradient_checkpointing: the architecture has it, or a UsageError
        prec.fp32_modules = policy.apply(cfg, model, accelerator, prec, bundle, settings, state)  # auto: measured here
        layout = Layout(cfg.batch_size, cfg.gradient_accumulation_steps, accelerator.process_index,
                        accelerator.num_processes)
        train = TrainBatches(bundle.train, layout, cfg.seed, accelerator.device, cfg.num_workers,
                             pin_memory=accelerator.device.type == "cuda",
                             variable_targets=bool(bundle.info.get("variable_targets")),  # chat: token-weighted steps
                             sum_over_processes=(lambda t: accelerator.reduce(t, "sum")) if layout.world_size > 1 else None)
        plan = Plan.make(cfg.optim, len(bundle.train), len(train), accelerator.num_processes)
        if plan.lr > config.MAX_LR:
            raise UsageError(f"the learning rate {plan.lr:g} (--lr {cfg.lr:g} scaled by --scale_lr) is above "
                             f"{config.MAX_LR:g}: training would diverge at once; lower --lr or raise --base_batch_size")
        preflight.optimizer(cfg.optim, model, plan.lr, plan.schedule_steps)  # made in memory before the folder is touched
        if refused is not None:  # said after the data's and the model's own checks, which name a bad value better
            raise refused
        if resume_path is not None:
            plan.resume_from(state, cfg.gradient_accumulation_steps)
            if plan.finished and state.step == plan.total_steps and out.resolve() in resume_path.resolve().parents:
                owed = _end_owed(accelerator, out, state.step, cfg)  # not None: cut short, export refused or another asked
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
            return _build(Start(cfg=cfg, accelerator=accelerator, prec=prec, model=model, bundle=bundle, train=train,
                                plan=plan, settings=settings, state=state, changes=changes, resume_path=resume_path,
                                folder=folder, echo=echo, plotter=plotter))
        except BaseException:
            folder.close()
            raise
    except BaseException:
        if plotter is not None:
            plotter.close()
        raise


def _contract(cfg, accelerator, prec, resume_path, state, fingerprint) -> tuple[dict, dict, UsageError | None]:
    """(the settings a checkpoint records, the allowed changes on resume, the refusal of the resume contract or
    None), from the settings alone: no data or model loaded (mixprec.run_folder.resume)."""
    try:
        samples, lr = Plan.rate(cfg.optim, accelerator.num_processes)
        settings = resume.trajectory(cfg, lr, samples, prec.effective, models.resolved_args(cfg.model, cfg.model_args),
                                     data.resolved_args(cfg.data), fingerprint)
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
    if _owed(out, state.step, cfg) is not None:
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


def _end_owed(accelerator, out: Path, step: int, cfg=None) -> str | None:
    """`_owed` as the main process finds it, on every process (one decision: the others follow it)."""
    owed = [_owed(out, step, cfg) if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(owed)
    return owed[0]


def _owed(out: Path, step: int, cfg=None) -> str | None:
    """What the end of the run in `out`, finished at `step`, still owes, in words (None: nothing): summary.json
    missing, not a completed run's (a halted job's, an end cut short by a full disk) or an earlier step's, its
    export refused (mixprec.models.hf_export.refused), or another export asked for (`--save_dtype`, `--merge_lora`
    typed, unlike the run's config.yaml: exported again by the run's own end, as recipes/export.py does). A later
    step's end (the run was extended since, and this is an older checkpoint) is left as it is."""
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    if not isinstance(summary, dict) or summary.get("status") != "completed" or \
            not isinstance(summary.get("steps"), int) or summary["steps"] < step:
        return "its summary.json is not this step's"
    if summary["steps"] != step:
        return None
    return "its export was refused" if hf_export.refused(summary) else _other_export(cfg, out)


def _other_export(cfg, out: Path) -> str | None:
    try:
        import yaml

        before = (yaml.safe_load((out / "config.yaml").read_text()) or {}).get("config") or {}
    except (OSError, ValueError, AttributeError):
        return None
    words = {True: "--merge_lora", False: "--no-merge_lora"}
    asked = [words.get(getattr(cfg, k), f"--{k} {getattr(cfg, k)}") for k in ("save_dtype", "merge_lora")
             if cfg is not None and config.set_by_user(cfg, k) and k in before and before[k] != getattr(cfg, k)]
    return f"{' and '.join(asked)} asks for another export than its own" if asked else None


def default_output_dir(cfg: ModelSettings, data: DataSettings) -> Path:
    """runs/<model>-<dataset>-<date>-<time>, the same on every process (the main one picks it)."""
    from accelerate.utils import broadcast_object_list

    stamp = [time.strftime("%Y%m%d-%H%M%S")]
    broadcast_object_list(stamp)
    return Path("runs") / f"{cfg.model}-{data.dataset}-{stamp[0]}"


def _measure(speed: SpeedSettings, optim: OptimSettings, accelerator, prec, model, bundle,
             state=None) -> tuple[dict, dict, list[str], tuple | None]:
    """FLOPs per sample, this process's CPU threads (one for a model too small to split: mixprec.devices.threads), the
    device's peak FLOP/s with those threads, and the modules' forward order, without touching the random
    state that training uses (dropout)."""
    devices = [accelerator.device.index or 0] if accelerator.device.type == "cuda" else []
    example = {k: torch.as_tensor(v)[None] for k, v in bundle.train[0].items()}
    threads = None
    with torch.random.fork_rng(devices=devices):
        cost = metrics.training_cost(model, example["inputs"][0], bundle.info)
        if accelerator.device.type == "cpu":
            recorded = _recorded_threads(state, accelerator.num_processes)  # a resume: the same count
            threads = hardware.set_cpu_threads(speed.cpu_threads, cost["flops_per_sample"] * optim.batch_size / 1e9,
                                               recorded)
        order = health.forward_order(model, example)
        peak = metrics.peak_flops(accelerator.device, prec.effective, speed.tf32, speed.peak_flops)
    return cost, peak, order, threads


def _recorded_threads(state, world: int) -> int | None:
    """The CPU threads per process the checkpoint's run used, where the resume can use them again: the same number
    of processes, and no more threads than this machine's usable cores share out."""
    if state is None or state.layout.get("world_size") != world or not state.layout.get("cpu_threads"):
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return state.layout["cpu_threads"] if state.layout["cpu_threads"] <= hardware.usable_cores() // local else None


def _build(start: Start) -> Start:
    """What comes between the checks and `accelerator.prepare`: the start-up measurements on the fp32 model, the
    speed options, the model's stored dtype (--master_weights bf16; --use_peft: the frozen base), the optimizer
    and the schedule."""
    cfg, model = start.cfg, start.model
    start.num_parameters = sum(p.numel() for p in model.parameters())  # before ZeRO-3 / FSDP shard them
    start.cost, start.peak, start.order, start.threads = _measure(cfg.speed, cfg.optim, start.accelerator, start.prec,
                                                                  model, start.bundle, start.state)
    start.speed_options = speed.apply(cfg.speed, cfg, model, start.accelerator.device)
    start.model = model = master_weights.prepare_model(cfg.precision, model, start.speed_options)  # bf16: after measuring
    lora.freeze_base(cfg.lora, model, start.prec)  # --use_peft: the frozen base in the autocast dtype, after them too
    plan = start.plan
    start.optimizer = master_weights.optimizer(cfg.precision, cfg.optim, model, plan.lr,
                                               fused=start.speed_options["fused_adamw"])
    start.lost_updates = LostUpdates(start.optimizer, cfg.health, cfg.run_folder, cfg.precision, plan.total_steps)
    start.lr_factor = optim.schedule(cfg.warmup_steps, plan.schedule_steps, cfg.lr_schedule, cfg.min_lr_ratio)
    start.scheduler = optim.scheduler(start.optimizer, cfg.warmup_steps, plan.schedule_steps, cfg.lr_schedule,
                                      cfg.min_lr_ratio)
    return start
