"""What the precision report runs on: the recipe's settings (the same --config, flags and defaults as
recipes/train.py, plus the report's own flags), real batches, and real weights: fresh, or from a run.

`--resume_from_checkpoint` names the weights, as in train.py: a checkpoint folder (checkpoints/step_N),
a run folder (its final model.safetensors, else its latest checkpoint), a .safetensors file, or `latest`
with `--output_dir RUN`. The run's config.yaml supplies the model and dataset settings unless the
command line (or --config) gives them.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml

from . import checkpointing
from .. import config
from ..config.arg_parser import Parser
from ..errors import UsageError

if TYPE_CHECKING:
    from ..config.sections import OptimSettings, RunFolderSettings

ADOPTED = ("model", "model_args", "dataset", "dataset_args", "train_file")  # taken from the run's config.yaml
WEIGHTS_FILE = "model.safetensors"


def own_parser() -> argparse.ArgumentParser:
    parser = Parser(add_help=False)
    parser.add_argument("--num_batches", type=int, default=8, help="real batches to analyse (default: 8)")
    parser.add_argument("--fp8_sqnr_threshold", type=float, default=20.0,
                        help="fp8: keep a Linear layer out of fp8 when an operand's SQNR is below this, in dB (default: 20)")
    return parser


def parse(argv: list[str], description: str) -> tuple[config.TrainConfig, argparse.Namespace, Path | None, str]:
    """The config (defaults < YAML < flags < nothing else), the report's own flags, the weights file, and
    where the model settings came from."""
    own, rest = own_parser().parse_known_args(argv)
    if own.num_batches <= 0:
        raise UsageError(f"--num_batches {own.num_batches} must be positive: give a value above 0")
    if not math.isfinite(own.fp8_sqnr_threshold):
        raise UsageError(f"--fp8_sqnr_threshold {own.fp8_sqnr_threshold} must be a number of dB, e.g. 20")
    cfg = config.parse_config(rest, description=description)
    cfg, weights, source = with_weights(cfg, rest)
    return cfg, own, weights, source


def with_weights(cfg, argv: list[str]) -> tuple[config.TrainConfig, Path | None, str]:
    """The weights that --resume_from_checkpoint names, and the config with the model and dataset settings of
    the run that wrote them unless `argv` (or --config) gives them; where those settings came from."""
    weights, run_config = locate_weights(cfg.run_folder)
    source = "the command line"
    given = {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}
    if run_config is not None and not given & {"config", *ADOPTED}:
        saved = (yaml.safe_load(run_config.read_text()) or {}).get("config", {})
        cfg = config.resolve(config.validate(config.replace(cfg, **{k: saved[k] for k in ADOPTED if k in saved})))
        source = str(run_config)
    return cfg, weights, source


def _run_config(weights: Path) -> Path | None:
    """The config.yaml of the run that wrote `weights` (RUN/model.safetensors or RUN/checkpoints/step_N/...)."""
    for folder in (weights.parent, weights.parent.parent.parent):
        candidate = folder / "config.yaml"
        if candidate.is_file() and isinstance(yaml.safe_load(candidate.read_text()), dict):
            return candidate
    return None


def locate_weights(cfg: RunFolderSettings) -> tuple[Path | None, Path | None]:
    spec = cfg.resume_from_checkpoint
    if not spec:
        return None, None
    if spec == "latest":
        found, _ = checkpointing.find(Path(cfg.output_dir) / "checkpoints")
        if found is None:
            raise UsageError(f"--resume_from_checkpoint latest: no checkpoint in {Path(cfg.output_dir) / 'checkpoints'}: "
                             f"give a run folder, a checkpoint folder or a .safetensors file")
        weights = found / WEIGHTS_FILE
    else:
        path = Path(spec)
        if not path.exists():
            raise UsageError(f"--resume_from_checkpoint '{spec}' does not exist: give a run folder, a checkpoint "
                             f"folder (runs/NAME/checkpoints/step_N) or a .safetensors file")
        if path.is_file():
            weights = path
        elif (path / WEIGHTS_FILE).is_file():
            weights = path / WEIGHTS_FILE
        elif (found := checkpointing.find(path / "checkpoints")[0]) is not None:
            weights = found / WEIGHTS_FILE
        else:
            raise UsageError(f"--resume_from_checkpoint '{spec}' holds no {WEIGHTS_FILE} and no checkpoint: give a "
                             f"run folder, a checkpoint folder or a .safetensors file")
    if weights.suffix != ".safetensors" or not weights.is_file():
        raise UsageError(f"--resume_from_checkpoint: '{weights}' is not a .safetensors weights file")
    return weights, _run_config(weights)


def load_weights(model: torch.nn.Module, path: Path, cfg) -> None:
    from safetensors.torch import load_file

    try:
        state = load_file(str(path))
    except Exception as err:  # a damaged or foreign file
        raise UsageError(f"cannot read weights from '{path}' ({type(err).__name__}): give a model.safetensors "
                         f"written by recipes/train.py") from None
    for prefix in ("module.", "_orig_mod."):  # DDP- or torch.compile-wrapped names
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError:
        raise UsageError(f"the weights in '{path}' do not fit --model {cfg.model} --model_args {cfg.model_args or '{}'}: "
                         f"give the settings the run was trained with (--config or --model_args)") from None


def prepare(cfg, weights: Path | None, count: int) -> tuple[torch.device, torch.nn.Module, list[dict]]:
    """What the report and the diff run on: the device (this process's CPU threads set as the recipe sets
    them), the model in fp32 with `weights` (or fresh from --seed), and the first `count` training batches."""
    from accelerate.utils import set_seed

    from .. import data, models
    from ..devices import hardware
    device = torch.device(hardware.device_type())
    if device.type == "cpu":
        hardware.set_cpu_threads(cfg.cpu_threads)
    set_seed(cfg.seed)
    bundle = data.build(cfg)
    model = models.build(cfg.model, bundle.info, cfg.model_args)
    if weights is not None:
        load_weights(model, weights, cfg)
    model.to(device=device, dtype=torch.float32)
    return device, model, batches(bundle, cfg.optim, count, device)


def weights_label(cfg, weights: Path | None) -> str:
    """Which weights a tool measured: a run's, a transformers checkpoint's, or fresh ones (and from what)."""
    if weights:
        return str(weights)
    if cfg.model_name_or_path:
        return f"{cfg.model_name_or_path} (the transformers checkpoint's)"
    if cfg.config_name:
        return f"fresh from {cfg.config_name}'s config (--seed {cfg.seed})"
    return f"fresh (--seed {cfg.seed})"


def batches(bundle, cfg: OptimSettings, count: int, device: torch.device) -> list[dict]:
    """The first `count` training batches of one process, in the order training takes them (--seed), on `device`."""
    from ..data.batches import Layout, TrainBatches

    out = []
    for batch in TrainBatches(bundle.train, Layout(cfg.batch_size), cfg.seed, device).epoch(0):
        out.append(batch)
        if len(out) == count:
            break
    if not out:
        raise UsageError(f"--batch_size {cfg.batch_size} is more than the {len(bundle.train)} training samples: lower it")
    return out


def output_dir(cfg) -> Path:
    if cfg.output_dir:
        return Path(cfg.output_dir)
    return Path("reports") / f"{cfg.model}-{cfg.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
