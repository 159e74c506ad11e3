"""The folders a run reads are the user's: a transformers model (`--model_name_or_path`), its config
(`--config_name`), its tokenizer (`--tokenizer_name`, `--dataset_args tokenizer=FOLDER`) and the data
(`--train_file`, a local `--dataset_name`). They are never written, never trusted blindly, never silently
swapped:

- `check_output(cfg, cfg.data, out)`: an --output_dir equal to or inside one of them, or containing a model
  folder, is refused before anything is touched (a run writes model.safetensors, hf_model/ and checkpoints/ into
  its folder, and --overwrite_output_dir removes them).
- `foreign(out)`: what in a folder shows a saved model, tokenizer, adapter or dataset, so that such a folder is
  never taken for an empty run folder, nor emptied by --overwrite_output_dir.
- `fingerprint(cfg)`: what the model sources hold, recorded in every checkpoint: config.json and the tokenizer's
  files by content (sha256), weights by their safetensors headers (every tensor's name, dtype, shape and
  offsets) and sizes, other weight files by size and their first and last MiB. `changed(saved, now)` names
  what differs, so that a resume whose model or tokenizer changed is refused before the folder is touched.
  A Hub id is recorded as the id (the Hub's files are not read here).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UsageError

if TYPE_CHECKING:
    from ..config.sections import DataSettings, ModelSettings

MODEL_FLAGS = ("model_name_or_path", "config_name", "tokenizer_name")
# files that a save_pretrained (model, tokenizer, peft adapter) or a datasets save_to_disk leaves; a run folder
# holds none of them at its top (its export goes to hf_model/, its adapter to adapter/)
SAVED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "adapter_config.json",
         "adapter_model.safetensors", "adapter_model.bin", "model.safetensors.index.json", "pytorch_model.bin",
         "pytorch_model.bin.index.json", "tf_model.h5", "dataset_info.json", "dataset_dict.json", "state.json")
RUN_MARKS = ("config.yaml", "metrics.jsonl", "checkpoints")  # what shows a folder holds a run of this recipe
FINGERPRINTED = (".json", ".safetensors", ".bin", ".pt", ".pth", ".model", ".txt", ".jinja", ".tiktoken", ".py")
WHOLE = 16 * 2**20  # files up to this size are hashed whole
EDGE = 2**20  # of bigger ones, the first and last MiB (and the size)


def _local(value) -> Path | None:
    if not value:
        return None
    path = Path(str(value)).expanduser()
    return path if path.exists() else None


def sources(cfg: ModelSettings, data: DataSettings) -> list[tuple[str, Path]]:
    """(flag, path) of every local folder or file the run reads, as the user typed them."""
    found = [(f"--{name}", _local(getattr(cfg, name, None))) for name in MODEL_FLAGS]
    tokenizer = (data.dataset_args or {}).get("tokenizer")
    found.append(("--dataset_args tokenizer", _local(tokenizer) if tokenizer not in (None, "bytes") else None))
    found.append(("--train_file", _local(data.train_file)))
    found.append(("--validation_file", _local(data.validation_file)))
    found.append(("--dataset_name", _local(data.dataset_name)))
    return [(flag, path) for flag, path in found if path is not None]


def check_output(cfg: ModelSettings, data: DataSettings, out: Path) -> None:
    """--output_dir must not be or lie inside a folder (or file) the run reads, nor contain a model's folder."""
    target = Path(os.path.realpath(out))
    for flag, path in sources(cfg, data):
        source = Path(os.path.realpath(path))
        if source == target:
            relation = "is"
        elif source in target.parents:
            relation = "is inside"
        elif target in source.parents and flag.split()[0].lstrip("-") in MODEL_FLAGS:  # a model, kept whole
            relation = "contains"
        else:
            continue
        raise UsageError(f"--output_dir '{out}' {relation} {flag} '{path}', which the run only reads (a run writes "
                         f"model.safetensors, hf_model/ and checkpoints/ into its folder): choose an --output_dir "
                         f"outside it")


def foreign(out: Path) -> str | None:
    """The first file in `out` that shows a saved model, tokenizer, adapter or dataset rather than a run of this
    recipe, or None. A model.safetensors counts unless the folder holds a run."""
    if not out.is_dir():
        return None
    for name in SAVED:
        if (out / name).exists():
            return name
    holds_run = any((out / name).exists() for name in RUN_MARKS)
    extra = sorted(p.name for p in out.glob("*.safetensors") if holds_run is False or p.name != "model.safetensors")
    return extra[0] if extra else None


def _safetensors_header(path: Path) -> str:
    """sha256 of a safetensors file's header (names, dtypes, shapes, offsets) and its size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        header = f.read(n) if 0 <= n <= min(size, 100 * 2**20) else b""
    return f"{size} bytes, header sha256 {hashlib.sha256(header).hexdigest()[:16]}"


def _file(path: Path) -> str:
    size = path.stat().st_size
    if path.suffix == ".safetensors":
        return _safetensors_header(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= WHOLE:
            digest.update(f.read())
        else:
            digest.update(f.read(EDGE))
            f.seek(size - EDGE)
            digest.update(f.read(EDGE))
    return f"{size} bytes, sha256 {digest.hexdigest()[:16]}"


def _folder(path: Path) -> dict[str, str]:
    if path.is_file():
        return {path.name: _file(path)}
    return {p.name: _file(p) for p in sorted(path.iterdir())
            if p.is_file() and p.suffix in FINGERPRINTED and not p.name.startswith(".")}


def fingerprint(cfg: ModelSettings) -> dict | None:
    """{flag: {"path": as typed, "files": {name: digest}}} of the model sources (None without any); a Hub id is
    {"hub": id}. An unreadable file is said in one line (exit 2)."""
    out = {}
    for name in MODEL_FLAGS:
        value = getattr(cfg, name, None)
        if not value:
            continue
        path = _local(value)
        if path is None:
            out[f"--{name}"] = {"hub": str(value)}
            continue
        try:
            out[f"--{name}"] = {"path": str(value), "files": _folder(path)}
        except OSError as err:
            raise UsageError(f"--{name} '{value}': {err.filename or path} cannot be read ({err.strerror}): check "
                             f"the folder's permissions") from None
    return out or None


def changed(saved: dict | None, now: dict | None) -> list[str]:
    """What differs between two fingerprints, in words ([] when nothing does, or when the checkpoint has none:
    checkpoints from before the fingerprint)."""
    if not saved:
        return []
    now = now or {}
    words = []
    for flag in sorted(set(saved) | set(now)):
        old, new = saved.get(flag), now.get(flag)
        if old is None or new is None:
            words.append(f"{flag} {'added' if old is None else 'dropped'}")
            continue
        if "files" not in old or "files" not in new:
            if old != new:
                words.append(f"{flag} {old.get('hub') or old.get('path')} -> {new.get('hub') or new.get('path')}")
            continue
        a, b = old["files"], new["files"]
        for name in sorted(set(a) | set(b)):
            if name not in b:
                words.append(f"{name} of {flag} removed")
            elif name not in a:
                words.append(f"{name} of {flag} added")
            elif a[name] != b[name]:
                words.append(f"{name} of {flag} changed ({a[name]} -> {b[name]})")
    return words


def check_unchanged(saved: dict | None, now: dict | None, checkpoint: Path) -> None:
    """A resume whose model sources changed since `checkpoint` is refused, naming what changed."""
    words = changed(saved, now)
    if words:
        more = f" and {len(words) - 3} more" if len(words) > 3 else ""
        raise UsageError(f"resume: the model's files changed since checkpoint {checkpoint}: {'; '.join(words[:3])}"
                         f"{more}: put the files back as they were, or start a new --output_dir to train on the "
                         f"new ones")


def describe(fp: dict | None) -> str:
    return json.dumps(fp, sort_keys=True) if fp else "none"
