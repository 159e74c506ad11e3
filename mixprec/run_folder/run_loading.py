"""What the precision report runs on: the recipe's settings (the same --config, flags and defaults as
recipes/train.py, plus the report's own flags), real batches, and real weights: fresh, or from a run.

`--resume_from_checkpoint` names the weights, as in train.py: a checkpoint folder (checkpoints/step_N),
a run folder (its final model.safetensors, else its latest checkpoint), a .safetensors file, or `latest`
with `--output_dir RUN`. The run's config.yaml supplies the model and dataset settings unless the
command line (or --config) gives them.

recipes/export.py exports a finished run again: `run_settings` (its config.yaml, as a resume takes it),
`run_weights` (its model.safetensors or a checkpoint, the model's files as the run found them), `check_folder`
(where the export goes), `rebuild` (the model as the run's start built it), then
mixprec.models.hf_export.export, and `record_export` (config.yaml's history, summary.json).
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
    from ..config.sections import ModelSettings, OptimSettings, RunFolderSettings

ADOPTED = ("model", "model_args", "dataset", "dataset_args", "train_file", "validation_file")  # taken from the run's config.yaml
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


def locate_weights(run_folder: RunFolderSettings) -> tuple[Path | None, Path | None]:
    spec = run_folder.resume_from_checkpoint
    if not spec:
        return None, None
    if spec == "latest":
        found, _ = checkpointing.find(Path(run_folder.output_dir) / "checkpoints")
        if found is None:
            raise UsageError(f"--resume_from_checkpoint latest: no checkpoint in "
                             f"{Path(run_folder.output_dir) / 'checkpoints'}: give a run folder, a checkpoint folder "
                             f"or a .safetensors file")
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


def load_weights(model: torch.nn.Module, path: Path, cfg: ModelSettings) -> None:
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


def weights_label(model: ModelSettings, seed: int, weights: Path | None) -> str:
    """Which weights a tool measured: a run's, a transformers checkpoint's, or fresh ones (and from what)."""
    if weights:
        return str(weights)
    if model.model_name_or_path:
        return f"{model.model_name_or_path} (the transformers checkpoint's)"
    if model.config_name:
        return f"fresh from {model.config_name}'s config (--seed {seed})"
    return f"fresh (--seed {seed})"


def batches(bundle, optim: OptimSettings, count: int, device: torch.device) -> list[dict]:
    """The first `count` training batches of one process, in the order training takes them (--seed), on `device`."""
    from ..data.batches import Layout, TrainBatches

    out = []
    for batch in TrainBatches(bundle.train, Layout(optim.batch_size), optim.seed, device).epoch(0):
        out.append(batch)
        if len(out) == count:
            break
    if not out:
        raise UsageError(f"--batch_size {optim.batch_size} is more than the {len(bundle.train)} training samples: "
                         f"lower it")
    return out


def output_dir(cfg) -> Path:
    if cfg.output_dir:
        return Path(cfg.output_dir)
    return Path("reports") / f"{cfg.model}-{cfg.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"


# recipes/export.py: a finished run's settings and weights --------------------------------------------------------

def run_settings(run: Path, typed: list[str]) -> tuple[config.TrainConfig, dict]:
    """The settings of the run in folder `run` as its config.yaml records them (as `--resume_from_checkpoint
    latest --output_dir RUN` takes them), the flags `typed` on top, and its summary.json ({} without one). One
    line (UsageError) for a folder that holds no run or a run without a transformers export."""
    import contextlib
    import io
    import json

    try:
        saved = (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("config")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        saved = None
    if not run.is_dir() or not isinstance(saved, dict):
        raise UsageError(f"'{run}' is not a run folder of recipes/train.py (no readable config.yaml): give the "
                         f"folder a run wrote, runs/NAME")
    if not str(saved.get("model", "")).startswith("hf_"):
        raise UsageError(f"the run in '{run}' trained --model {saved.get('model')}, not a transformers model: it has "
                         f"no transformers export (its weights are {run / WEIGHTS_FILE})")
    if "--merge_lora" in typed and not saved.get("use_peft"):
        raise UsageError(f"the run in '{run}' trained no LoRA adapters (no --use_peft): --merge_lora has nothing to "
                         f"merge; drop it")
    with contextlib.redirect_stdout(io.StringIO()):  # the resume's "settings from config.yaml" line: not a resume
        cfg = config.parse_config(["--resume_from_checkpoint", "latest", "--output_dir", str(run), *typed])
    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    return cfg, summary if isinstance(summary, dict) else {}


def run_weights(cfg: ModelSettings, run: Path, checkpoint: str | None) -> tuple[Path, int | None]:
    """(the weights file, its step) of the run in `run`: its final model.safetensors, or `checkpoint` (a
    checkpoint folder, or `latest` in run/checkpoints). Refused in one line: a missing or damaged checkpoint, a
    run that has not finished (no model.safetensors) without --checkpoint, and model files (config.json, the
    tokenizer, the weights' headers: mixprec.run_folder.sources.fingerprint) changed since the checkpoint that
    recorded them (the model is rebuilt from them)."""
    from . import sources

    found, _ = checkpointing.find(run / "checkpoints")
    if checkpoint is None:
        weights = run / WEIGHTS_FILE
        if not weights.is_file():
            raise UsageError(f"the run in '{run}' has no {WEIGHTS_FILE} (it has not finished): give --checkpoint "
                             f"latest or --checkpoint {run / 'checkpoints' / 'step_N'}")
    elif checkpoint == "latest":
        if found is None:
            raise UsageError(f"--checkpoint latest: no complete checkpoint in {run / 'checkpoints'}: export the "
                             f"finished run's {WEIGHTS_FILE} (drop --checkpoint)")
    else:
        found = Path(checkpoint)
        problem = checkpointing.verify(found) if found.is_dir() else "no such folder"
        if problem is not None:
            raise UsageError(f"--checkpoint '{checkpoint}' is not a complete checkpoint ({problem}): give a "
                             f"{run / 'checkpoints' / 'step_N'} folder, or latest")
    recorded = checkpointing.load_state(found) if found is not None else None
    words = sources.changed(recorded.settings.get("sources"), sources.fingerprint(cfg)) if recorded else []
    if words:
        more = f" and {len(words) - 3} more" if len(words) > 3 else ""
        raise UsageError(f"the model's files changed since checkpoint {found}: {'; '.join(words[:3])}{more}: put "
                         f"them back as they were (the export rebuilds the model from them)")
    if checkpoint is None:
        return weights, None
    return found / WEIGHTS_FILE, recorded.step


def check_folder(cfg, run: Path, folder: Path, key: str) -> None:
    """Where recipes/export.py writes a run's export (`key`: hf_export or lora_export) may hold only an export of
    this recipe (EXPORT_MARK), which it replaces whole; a file, a link or a folder of the user's there, a folder
    inside a model folder the run reads, a run in use (its lock held), are one line (UsageError)."""
    import os

    from . import rundir, sources
    from ..models.hf_export import EXPORT_MARK

    sources.check_output(cfg, cfg.data, folder)  # never inside the model's, the tokenizer's or the data's folder
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise UsageError(f"'{folder}' is {'a link' if folder.is_symlink() else 'a file'}, where the export would go: "
                         f"move it away, or give another --output_dir")
    if folder.is_dir() and not rundir.ours(folder):
        raise UsageError(f"'{folder}' is a folder this recipe did not write (no {EXPORT_MARK}): it is never "
                         f"replaced; move it away, or give another --output_dir")
    if key == "lora_export" and folder.name != "adapter":
        raise UsageError(f"--output_dir '{folder}': an adapter (LoRA, not merged) is written to a folder named "
                         f"adapter: give --output_dir {folder / 'adapter'}, or add --merge_lora")
    probe = next((p for p in folder.parents if p.exists()), Path("."))
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"'{folder}' cannot be written ('{probe}' is not a writable folder): give another "
                         f"--output_dir")
    holder = rundir._holder(run)
    if holder:
        raise UsageError(f"the run in '{run}' is in use ({holder}): wait for it to end")


def rebuild(cfg, weights: Path, effective: str):
    """The run's model as its start built it (the data's vocabulary and block size, --use_peft's adapters on
    the base, the tokenizer it used: mixprec.models.hf_export.keep_tokenizer), holding `weights`, in fp32 on
    the CPU. `effective`: the run's precision (bf16 or fp16 for the LoRA base)."""
    from types import SimpleNamespace

    from accelerate.utils import set_seed

    from .. import data, models
    from ..models import hf_export, lora

    set_seed(cfg.seed)
    bundle = data.build(cfg)
    prec = SimpleNamespace(effective=effective if effective in lora.DTYPES else "bf16")
    model = lora.apply(cfg.lora, models.build(cfg.model, bundle.info, cfg.model_args), prec)
    hf_export.keep_tokenizer(cfg, cfg.data, model)
    load_weights(model, weights, cfg)
    return model.to(dtype=torch.float32)


def record_export(run: Path, key: str, result: dict, weights: Path, step: int | None) -> str:
    """What recipes/export.py did, in the run's own record where it fits: config.yaml's history gets an
    `exported` entry, and summary.json's `hf_export` (or `lora_export`) is replaced when the export replaced the
    run's own folder (the one it names). Returns what was recorded, in words."""
    import json
    import sys

    from ..tracking import write_json

    where = []
    summary_path, config_path = run / "summary.json", run / "config.yaml"
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        summary = None
    own = run / ("hf_model" if key == "hf_export" else "adapter")  # what summary.json's entry names
    if isinstance(summary, dict) and Path(result["path"]).resolve() == own.resolve():
        write_json(summary_path, {**summary, key: {**result, "weights": str(weights)}})
        where.append(f"{summary_path.name}'s {key}")
    saved = yaml.safe_load(config_path.read_text())
    entry = {"event": "exported", "step": step if step is not None else (summary or {}).get("steps"),
             "command": " ".join(sys.argv), "weights": str(weights),
             key: {k: result[k] for k in ("status", "dtype", "path") if k in result}}
    checkpointing.write_atomic(config_path, yaml.safe_dump({**saved, "history": [*(saved.get("history") or []),
                                                                                 entry]}, sort_keys=False))
    where.append(f"{config_path.name}'s history")
    return " and ".join(where)
