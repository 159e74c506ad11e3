"""Several processes: one real process group, and one source of truth for precision and batch.

The hardware is an Accelerate config in `accelerate_configs/`; `accelerate launch` turns it into
environment variables, which `Launch.from_env` reads. This module keeps the silent failures out:

- A launch that asked for several processes but started one (`accelerate launch --cpu --num_processes
  2`, or `distributed_type: MULTI_CPU` without mpirun) or several processes that each train alone
  (WORLD_SIZE > 1, but no process group) is a UsageError before anything is trained.
- On a CPU, several processes form a gloo group (`Accelerator(cpu=True)`; DeepSpeed: gloo backend).
- FSDP does not engage on a CPU in Accelerate 1.15 (the model would quietly get DDP): a UsageError.
- DeepSpeed: its config is derived from the recipe's settings (`deepspeed_config`): micro batch =
  --batch_size, gradient_accumulation_steps, train_batch_size = micro x accumulation x world size,
  gradient_clipping = --max_grad_norm, the bf16/fp16 sections (and loss scaling) from the effective
  precision. A value a DeepSpeed config file or the Accelerate config sets differently is a UsageError.
- `describe` says what the engine really holds: under DeepSpeed 16-bit the model's weights are 16-bit
  and the fp32 master weights live in ZeRO's optimizer partitions, so evaluation cannot be fp32.
"""
from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .. import compat
from ..errors import UsageError
from ..unwrap import unwrap

if TYPE_CHECKING:
    from ..config.sections import OptimSettings, PrecisionSettings

WORLD_SIZE_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
DS_FILE_VAR = "ACCELERATE_DEEPSPEED_CONFIG_FILE"
_ON = ("1", "true", "yes")


def _flag(env, name: str) -> bool:
    return str(env.get(name, "false")).lower() in _ON


def launched_world_size(env=os.environ) -> int:
    """How many processes the launcher started (torchrun, mpirun); 1 without a launcher."""
    for name in WORLD_SIZE_VARS:
        if env.get(name, "").isdigit():
            return int(env[name])
    return 1


@dataclass
class Launch:
    """What `accelerate launch` (or torchrun) asked for, read from the environment."""
    device: str  # cuda | cpu | mps
    world_size: int = 1
    deepspeed: bool = False
    fsdp: bool = False
    ds_file: str | None = None  # a DeepSpeed JSON config named by the Accelerate config
    ds_raw: dict = field(default_factory=dict)  # that file's content, or the Accelerate config's fields

    @classmethod
    def from_env(cls, device: str, env=os.environ) -> "Launch":
        check_launch(env)
        launch = cls(device, launched_world_size(env), _flag(env, "ACCELERATE_USE_DEEPSPEED"),
                     _flag(env, "ACCELERATE_USE_FSDP"))
        if launch.fsdp and device != "cuda":
            raise UsageError(
                f"FSDP needs CUDA GPUs: on {device} the pinned Accelerate does not shard (it would quietly wrap the "
                f"model in DDP); use accelerate_configs/multi_cpu.yaml, or deepspeed_zero3.yaml to shard on CPUs")
        if launch.deepspeed:
            launch.ds_file, launch.ds_raw = deepspeed_source(env)
        return launch

    def precision_requirement(self, requested: str, launcher: str | None) -> str | None:
        """The precision the launch demands (Accelerate config, or DeepSpeed config file), or None."""
        demanded = deepspeed_precision(self.ds_raw, self.ds_file) if self.deepspeed else None
        if demanded is None:
            return launcher
        where = f"the DeepSpeed config {self.ds_file}"
        if launcher not in (None, "no", demanded):
            raise UsageError(f"the accelerate config's mixed_precision={launcher} disagrees with {where} "
                             f"({demanded} enabled): make them the same")
        if requested not in ("auto", demanded):
            raise UsageError(f"--mixed_precision {requested} disagrees with {where}, which enables {demanded}: "
                             f"pass --mixed_precision {demanded}, or set \"enabled\": \"auto\" there")
        return demanded

    def accelerator_kwargs(self, optim: OptimSettings, precision: PrecisionSettings, effective: str) -> dict:
        """`cpu`, `deepspeed_plugin` and handlers for the Accelerator of this launch."""
        if not self.deepspeed:
            # several processes on a CPU form a gloo group only when Accelerate is told to use the CPU
            return {"cpu": self.device == "cpu", "kwargs_handlers": []}
        from accelerate.utils import DeepSpeedPlugin

        if effective == "fp8":
            raise UsageError("--mixed_precision fp8 with DeepSpeed needs MS-AMP, which this recipe does not support: "
                             "use bf16 with DeepSpeed, or fp8.yaml (DDP)")
        if effective == "fp16" and self.device == "cpu" and not deepspeed_cpu_fp16():
            raise UsageError("--mixed_precision fp16 with DeepSpeed on CPUs: DeepSpeed's CPU accelerator has no fp16 "
                             "on this CPU (it needs oneDNN fp16: AVX512-FP16 or AMX-FP16): use bf16 or fp32 with "
                             "DeepSpeed, or fp16 with multi_cpu.yaml (DDP)")
        ds = deepspeed_config(self.ds_raw, self.ds_file, micro_batch=optim.batch_size,
                              accumulation=optim.gradient_accumulation_steps, world_size=self.world_size,
                              clipping=optim.max_grad_norm, precision=effective, init_scale=precision.init_scale,
                              growth_interval=precision.growth_interval)
        try:
            plugin = DeepSpeedPlugin(hf_ds_config=ds) if self.ds_file else _plugin_from_fields(ds)
        except ValueError as err:  # Accelerate refuses fields set both in its config and in the JSON
            raise UsageError(" ".join(str(err).split())) from None
        return {**compat.deepspeed_on_cpu(self.device), "deepspeed_plugin": plugin}

    def check_world(self, accelerator) -> None:
        """Several processes launched must be one process group; DeepSpeed asked for must be engaged."""
        from accelerate.utils import DistributedType

        if self.deepspeed and accelerator.distributed_type != DistributedType.DEEPSPEED:
            raise UsageError(f"the launch asked for DeepSpeed but Accelerate set up {accelerator.distributed_type}: "
                             f"launch with accelerate_configs/deepspeed_zero2.yaml or deepspeed_zero3.yaml")
        if self.world_size > 1 and accelerator.num_processes != self.world_size:
            raise UsageError(
                f"{self.world_size} processes were launched but each would train alone (Accelerate sees "
                f"{accelerator.num_processes} process, {accelerator.distributed_type}): on a CPU launch with "
                f"accelerate_configs/multi_cpu.yaml, or set ACCELERATE_USE_CPU=true for torchrun")


def deepspeed_cpu_fp16() -> bool:
    """Whether DeepSpeed's CPU accelerator trains in fp16 here (it refuses otherwise, inside `prepare`)."""
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def engine_of(accelerator) -> str:
    """What wrote (or will write) a checkpoint: 'deepspeed-zero<N>', 'fsdp' or 'torch' (one process or DDP)."""
    kind = accelerator.distributed_type.name
    if kind == "DEEPSPEED":
        return f"deepspeed-zero{accelerator.deepspeed_plugin.deepspeed_config['zero_optimization']['stage']}"
    return "fsdp" if kind == "FSDP" else "torch"


def check_resume_engine(saved: dict, engine: str, world_size: int, checkpoint) -> None:
    """A checkpoint resumes under the engine that wrote it; a sharded one (ZeRO, FSDP) on as many processes."""
    old_engine, old_world = saved.get("engine", "torch"), saved.get("world_size", world_size)
    if old_engine != engine:
        raise UsageError(f"checkpoint {checkpoint} was written by {old_engine}, this run uses {engine}: resume with "
                         f"the accelerate config that wrote it (its files differ)")
    if engine != "torch" and old_world != world_size:
        raise UsageError(
            f"checkpoint {checkpoint} is sharded over {old_world} processes ({engine}), this run has {world_size}: "
            f"resume on {old_world} processes"
            + (", or convert it to a universal checkpoint (python -m deepspeed.checkpoint.ds_to_universal "
               "--inject_missing_state), which this recipe does not load yet" if engine.startswith("deepspeed") else ""))


def check_launch(env=os.environ) -> None:
    """`accelerate launch`'s one-process launcher sets MASTER_ADDR/PORT only when asked for several
    processes (or machines); without mpirun it then starts just one. Say so instead of training alone."""
    simple_launcher = "ACCELERATE_USE_CPU" in env and "LOCAL_RANK" not in env
    if simple_launcher and env.get("MASTER_ADDR") and env.get("MASTER_PORT") and launched_world_size(env) == 1:
        raise UsageError(
            "accelerate launch was asked for several processes but started only this one (--cpu --num_processes "
            "N, or distributed_type MULTI_CPU, needs mpirun): use --config_file accelerate_configs/multi_cpu.yaml, "
            "or --multi_gpu --num_processes N, which form a gloo group on CPUs")


def deepspeed_source(env=os.environ) -> tuple[str | None, dict]:
    """The DeepSpeed settings the launch gives: a JSON file, or the Accelerate config's fields."""
    path = env.get(DS_FILE_VAR, "none")
    if path and path != "none":
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise UsageError(f"DeepSpeed config file '{path}' (deepspeed_config_file) not found: check the path") from None
        except json.JSONDecodeError as err:
            raise UsageError(f"DeepSpeed config file '{path}' is not valid JSON (line {err.lineno}): fix it") from None
        if not isinstance(raw, dict) or "zero_optimization" not in raw:
            raise UsageError(f"DeepSpeed config file '{path}' has no zero_optimization section: add one, e.g. "
                             f"\"zero_optimization\": {{\"stage\": 2}}")
        for section in ("optimizer", "scheduler"):
            if section in raw:
                raise UsageError(f"DeepSpeed config file '{path}' has a '{section}' section, but the recipe brings its "
                                 f"own AdamW and learning-rate schedule (--lr, --lr_schedule): remove the section")
        return path, raw
    raw = {"zero_optimization": {
        "stage": int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2)),
        "offload_optimizer": {"device": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")},
        "offload_param": {"device": env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")}}}
    if "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL" in env:
        raw["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = _flag(
            env, "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL")
    for key, var, typ in (("gradient_accumulation_steps", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", int),
                          ("gradient_clipping", "ACCELERATE_GRADIENT_CLIPPING", float)):
        if env.get(var, "auto") not in ("auto", "none", ""):
            raw[key] = typ(env[var])
    return None, raw


def _plugin_from_fields(ds: dict):
    """A DeepSpeedPlugin from the Accelerate config's fields (env), then holding the derived values."""
    from accelerate.utils import DeepSpeedPlugin

    zero = ds["zero_optimization"]
    plugin = DeepSpeedPlugin(gradient_accumulation_steps=ds["gradient_accumulation_steps"],
                             gradient_clipping=ds["gradient_clipping"], zero_stage=zero["stage"],
                             zero3_save_16bit_model=zero.get("stage3_gather_16bit_weights_on_model_save", False))
    plugin.deepspeed_config.update(copy.deepcopy(ds))
    return plugin


def _enabled(section) -> bool | None:
    """A precision section's `enabled`: True, False, or None for absent/"auto"."""
    if not isinstance(section, dict) or str(section.get("enabled", "auto")).lower() == "auto":
        return None
    return str(section["enabled"]).lower() in _ON


def deepspeed_precision(raw: dict, source: str | None) -> str | None:
    """The precision a DeepSpeed JSON config demands: 'fp16', 'bf16', 'no', or None (auto or silent)."""
    fp16, bf16 = _enabled(raw.get("fp16")), _enabled(raw.get("bf16"))
    if fp16 and bf16:
        raise UsageError(f"the DeepSpeed config {source} enables both fp16 and bf16: enable one (or set both to \"auto\")")
    if fp16 or bf16:
        return "fp16" if fp16 else "bf16"
    if fp16 is False and bf16 is False:
        return "no"
    return None


def _check(have, want, key: str, source: str, fix: str) -> None:
    if have is None or str(have).lower() == "auto":
        return
    if isinstance(want, float) or isinstance(have, float):
        same = math.isclose(float(have), float(want))
    else:
        same = have == want
    if not same:
        raise UsageError(f"{key}={have} in {source} disagrees with the recipe ({key}={want}): {fix}")


def deepspeed_config(raw: dict, source: str | None, *, micro_batch: int, accumulation: int, world_size: int,
                     clipping: float, precision: str, init_scale: float, growth_interval: int) -> dict:
    """The DeepSpeed config for this run: `raw` with every batch, clipping and precision value derived
    from the recipe's settings. A value `raw` sets differently is a UsageError naming both."""
    where = f"the DeepSpeed config {source}" if source else "the accelerate config's deepspeed_config"
    fix = f"remove it from {where} (or set \"auto\"): the recipe's flags decide"
    ds = copy.deepcopy(raw)
    want = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
            "train_batch_size": micro_batch * accumulation * world_size, "gradient_clipping": float(clipping)}
    for key, value in want.items():
        _check(ds.get(key), value, key, where, fix if key != "train_batch_size" else
               f"it must be micro batch {micro_batch} x accumulation {accumulation} x world size {world_size}; {fix}")
        ds[key] = value
    for dtype in ("fp16", "bf16"):
        section = dict(ds.get(dtype) or {})
        if _enabled(section) is not None and _enabled(section) != (precision == dtype):
            raise UsageError(f"{where} has {dtype}.enabled={section['enabled']} but the recipe trains in {precision}: "
                             f"make them the same (or set \"enabled\": \"auto\")")
        section["enabled"] = precision == dtype
        ds[dtype] = section
    if precision == "fp16":  # DeepSpeed's dynamic loss scaling, from the recipe's GradScaler settings
        power = math.log2(init_scale)
        if not power.is_integer():
            raise UsageError(f"--init_scale {init_scale:g} is not a power of two, which DeepSpeed's loss scaler "
                             f"needs: use e.g. {2 ** round(power):g}")
        scaling = {"loss_scale": 0, "initial_scale_power": int(power), "loss_scale_window": growth_interval,
                   "hysteresis": 1, "min_loss_scale": 1}
        for key, value in scaling.items():
            _check(ds["fp16"].get(key), value, f"fp16.{key}", where, fix)
            ds["fp16"][key] = value
    zero = ds.setdefault("zero_optimization", {})
    if zero.get("stage", 0) == 3:  # final weights: gather the shards into one full file
        if zero.get("stage3_gather_16bit_weights_on_model_save") is False:
            raise UsageError(f"{where} sets stage3_gather_16bit_weights_on_model_save false, so ZeRO-3 could not "
                             f"write the final weights: set it true (zero3_save_16bit_model: true)")
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    ds["steps_per_print"] = float("inf")  # DeepSpeed's own logging off: the recipe logs
    return ds


def like_ddp(accelerator, model) -> None:
    """Under DeepSpeed: inputs and buffers in the weights' dtype, buffers broadcast from process 0 (compat.like_ddp)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        compat.like_ddp(unwrap(accelerator, model))


def describe(accelerator, model, effective: str, optimizer=None) -> dict:
    """What the engine holds, for the banner and config.yaml (only the keys that differ from plain DDP)."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        ds = accelerator.deepspeed_plugin.deepspeed_config
        stage = ds["zero_optimization"]["stage"]
        weights = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
        master = compat.zero_master_dtype(optimizer) if optimizer is not None else None
        info = {"engine": f"DeepSpeed ZeRO-{stage}",
                "deepspeed": {k: ds[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                                 "train_batch_size", "gradient_clipping")},
                "model_weight_dtype": ",".join(weights), "master_weight_dtype": master or ",".join(weights),
                "master_weight_note": f"in DeepSpeed's optimizer, sharded over {accelerator.num_processes} processes"}
        if effective in ("fp16", "bf16"):
            info["autocast_dtype"] = f"none (DeepSpeed runs the model in {effective})"
            info["eval_precision"] = f"{effective} (DeepSpeed holds the model's weights in {effective}: no fp32 evaluation)"
        if effective == "fp16":
            scale = ds["fp16"]
            info["grad_scaler"] = (f"DeepSpeed dynamic loss scaling (initial 2^{scale['initial_scale_power']}, "
                                   f"window {scale['loss_scale_window']})")
        return info
    if kind == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        kind = getattr(plugin.state_dict_type, "name", str(plugin.state_dict_type)).lower()
        info = {"engine": f"FSDP{plugin.fsdp_version} ({kind})"}
        if effective in ("bf16", "fp16"):
            info["eval_precision"] = f"{effective} (FSDP's param_dtype policy computes in {effective}: no fp32 evaluation)"
        return info
    if accelerator.num_processes > 1:
        return {"engine": "DDP (DistributedDataParallel)"}
    return {}


def main_print(accelerator):
    """`print` on the global main process only (`accelerator.print` prints once per node)."""
    if accelerator.is_main_process:
        return lambda *args, **kwargs: print(*args, **kwargs, flush=True)
    return lambda *args, **kwargs: None
