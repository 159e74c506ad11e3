"""Checks that build or size what the run needs before the run folder is touched, for values that pass the
settings' own checks but fail only when the object is made (a GradScaler's scale that overflows float32, a
model or dataset larger than the machine's memory, a folder name longer than the file system allows).

Each failure is a UsageError: one line naming the setting and the fix, exit code 2, nothing on disk changed.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import UsageError, explain  # noqa: F401  # explain: data, rundir name it preflight.explain

if TYPE_CHECKING:
    from .config.sections import OptimSettings

# weights (fp32), gradients (fp32) and AdamW's two moments (fp32): bytes per parameter while training
TRAINING_BYTES_PER_PARAMETER = 16


def available_bytes(device=None) -> int:
    """Memory this process may use: the GPU's free memory on CUDA, else the machine's available memory shared
    by the processes of this machine."""
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil

        free = int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover (psutil comes with accelerate)
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return free // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _size(n: float) -> str:
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} bytes"


def require_memory(nbytes: float, what: str, fix: str, device=None) -> None:
    """Refuse `what` (naming its settings) when it needs more than the memory available."""
    have = available_bytes(device)
    if nbytes > have:
        where = "this GPU's free memory" if getattr(device, "type", "cpu") == "cuda" else "this machine's available memory"
        raise UsageError(f"{what} needs {_size(nbytes)}, more than {where} ({_size(have)}): {fix}")


def model_memory(name: str, info: dict, model_args: dict, device=None) -> None:
    """Build the model on torch's meta device (no memory), count its parameters and refuse a model whose
    weights, gradients and AdamW state do not fit."""
    import torch

    from . import models

    with torch.device("meta"):
        model = models.build(name, info, model_args)
    params = sum(p.numel() for p in model.parameters())
    shaped_by = ", ".join(f"{k}={v}" for k, v in (model_args or {}).items())
    data = ", ".join(f"{k} {info[k]}" for k in ("num_classes", "vocab_size", "num_features") if k in info)
    what = (f"--model {name}" + (f" with --model_args {shaped_by}" if shaped_by else "") +
            f" ({params:,} parameters for the data's {data}; weights, gradients and AdamW state)")
    require_memory(params * TRAINING_BYTES_PER_PARAMETER, what,
                   "choose smaller --model_args, or check the data's labels (class numbers from 0)", device)


def hf_model_memory(name: str, model_args: dict, device=None) -> None:
    """A transformers model sized from its config on the meta device (from_pretrained refuses that device), and
    refused as `model_memory` refuses one, before its weights are read."""
    from .models import hf

    if not (model_args.get("name_or_path") or model_args.get("config_name")):
        raise UsageError(f"--model {name} is a transformers model: give --model_name_or_path PATH (or --config_name "
                         f"FOLDER --tokenizer_name FOLDER) instead")
    params = hf.parameters_from_config(name, model_args)
    flag = (f"--model_name_or_path {model_args['name_or_path']}" if model_args.get("name_or_path")
            else f"--config_name {model_args['config_name']}")
    require_memory(params * TRAINING_BYTES_PER_PARAMETER, f"{flag} ({params:,} parameters by its config.json; "
                   f"fp32 weights, gradients and AdamW state)", "choose a smaller model, or more memory", device)


def grad_scaler(init_scale: float, growth_interval: int) -> None:
    """Make the GradScaler fp16 training will use, and take one step with it, on the CPU: torch keeps the scale in
    float32 and the growth tracker in int32/int64, so a value that passes as a Python number can still fail."""
    import torch

    problem = None
    if not 0 < init_scale <= torch.finfo(torch.float32).max or float(torch.tensor(init_scale)) == 0:
        problem = (f"--init_scale {init_scale:g} is not a loss scale float32 can hold (above 0, at most 3.4e38): give "
                   f"a value like 65536 (the default)")
    elif growth_interval > torch.iinfo(torch.int32).max:
        problem = (f"--growth_interval {growth_interval} is beyond the GradScaler's int32 step counter "
                   f"({torch.iinfo(torch.int32).max}): give a smaller value (default 2000)")
    else:
        try:
            scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
            weight = torch.nn.Parameter(torch.ones(1))
            optimizer = torch.optim.SGD([weight], lr=0.0)
            scaler.scale(weight.sum()).backward()
            scaler.step(optimizer)
            scaler.update()
        except (RuntimeError, OverflowError, ValueError) as err:
            problem = (f"--init_scale {init_scale:g} / --growth_interval {growth_interval} cannot make a GradScaler "
                       f"({str(err).splitlines()[0]}): give values like 65536 and 2000")
    if problem:
        raise UsageError(problem)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long, a loop of links: Path.exists raises for these
        return False


def checked_exists(path: Path, flag: str) -> bool:
    """Whether `path` exists, an OSError other than 'no such file' being one line that says what to do. A named
    pipe, a device or a socket is refused: every path a flag names is a file or a folder, which a run may read
    more than once (a pipe is empty after the first read, and blocks until something writes to it)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as err:
        raise explain(err, flag, path) from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        what = "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        raise UsageError(f"{flag} '{path}' is {what}, not a file or a folder: give a regular file")
    return True


def path_names(path: Path, flag: str) -> None:
    """Refuse a path whose folder or file names are longer than the file system allows, before any is made."""
    probe = next((p for p in [path, *path.parents] if _exists(p)), Path("."))
    try:
        name_max = os.pathconf(probe if probe.is_dir() else probe.parent, "PC_NAME_MAX")
        path_max = os.pathconf(probe if probe.is_dir() else probe.parent, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    for part in path.parts:
        if len(os.fsencode(part)) > name_max:
            raise UsageError(f"{flag} '{path}': the name '{part[:40]}...' has {len(os.fsencode(part))} bytes, more "
                             f"than the {name_max} this file system allows: choose a shorter name")
    if len(os.fsencode(str(path.absolute()))) >= path_max:
        raise UsageError(f"{flag} '{path}' is longer than the {path_max} bytes this file system allows: choose a "
                         f"shorter path")


def optimizer(cfg: OptimSettings, model, lr: float, schedule_steps: int) -> None:
    """Make AdamW and the learning-rate schedule in memory (no step, no state) and refuse what would ruin the
    weights at the first step: decoupled weight decay multiplies every weight by 1 - lr x weight_decay."""
    from . import optim

    factor = 1 - lr * cfg.weight_decay
    if factor <= 0:
        raise UsageError(f"--weight_decay {cfg.weight_decay:g} with the learning rate {lr:g}: AdamW multiplies every "
                         f"weight by 1 - lr x weight_decay = {factor:.3g} each step, which erases or flips the "
                         f"weights: give a --weight_decay below {1 / lr:.3g} (e.g. 0.01)")
    try:
        built = optim.adamw(model, lr, cfg.weight_decay, fused=False)
        optim.scheduler(built, cfg.warmup_steps, schedule_steps, cfg.lr_schedule, cfg.min_lr_ratio)
        lr_factor = optim.schedule(cfg.warmup_steps, schedule_steps, cfg.lr_schedule, cfg.min_lr_ratio)
        factors = [lr_factor(step) for step in {0, cfg.warmup_steps, schedule_steps}]
    except (ValueError, RuntimeError, OverflowError, ZeroDivisionError) as err:
        raise UsageError(f"the optimizer or the learning-rate schedule cannot be made ({str(err).splitlines()[0]}): "
                         f"check --lr, --weight_decay, --warmup_steps and --lr_schedule") from None
    if not all(0 <= f < float("inf") for f in factors):
        raise UsageError(f"the learning-rate schedule gives factors {factors}: check --warmup_steps and "
                         f"--lr_schedule")
