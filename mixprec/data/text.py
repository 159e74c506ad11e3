"""Text for language models: this Python's standard library (offline default), local .txt files, and the
common pipeline that Hub text datasets (wikitext, ...) also go through (hub.py).

Documents are tokenized (`map`, cached), concatenated and cut into blocks of `block_size + 1` tokens that
overlap by one: `inputs` are a block's first `block_size` tokens and `labels` the same shifted by one, so
every token of the stream is predicted exactly once. What does not fill a block at the end of a `map`
batch of 1,000 documents is dropped.

`block_size` is the model's context length (`block_size` in its preset or `--model_args`), unless
`--dataset_args block_size=N` asks for shorter blocks (a transformers model: `--block_size N`, which
mixprec.models.hf_flags sets here).

Tokens: bytes by default (`tokenizer=bytes`: the UTF-8 bytes, a vocabulary of 256, nothing to download);
`--dataset_args tokenizer=NAME` loads a Hugging Face tokenizer instead (e.g. `gpt2`: downloaded once on a
connected machine, or a local folder), and rows (documents) are separated by its end-of-text token, unless
`separate_rows=false` (rows that are lines or paragraphs of one text, as in wikitext and --dataset text).

- stdlib: the `.py` files of the standard library of the Python running the recipe (tests, test suites and
  site-packages left out), about 12 MB; each file is a document. A file belongs to validation when the
  hash of its path relative to the library falls in the first `val_fraction` (5%), so the split is
  the same on every run and machine with the same Python, and no file is in both.
- text: `--train_file` a .txt file or a folder of them (read line by line, line breaks kept); validation is
  `--validation_file` (a .txt file or folder too), else the last `val_fraction` of the lines.
"""
from __future__ import annotations

import sys
import sysconfig
import zlib
from pathlib import Path

import numpy as np
from datasets import Dataset, DatasetDict

from .. import preflight
from ..errors import UsageError
from ..typed_args import Setting, fraction, positive
from . import DataBundle, _args, _local_path, cached, register
from .checks import named, share, validation_file

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config.sections import DataSettings, ModelSettings

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
TEXT_ARGS = {"block_size": positive(None, optional=True), "tokenizer": Setting("bytes", str),
             "max_val_samples": positive(None, optional=True), "val_fraction": fraction(0.05),
             "separate_rows": Setting(True, bool)}
RANDOM_TOKENS = {"vocab_size": Setting(50304, int, 2), "num_samples": positive(1024), "num_val": positive(32),
                 "block_size": positive(None, optional=True)}


class ByteTokenizer:
    """UTF-8 bytes as tokens: a vocabulary of 256, no unknown tokens, no download."""

    name, vocab_size, eos_token_id = "bytes", 256, None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer by name or folder (`transformers.AutoTokenizer`); `flag`: where it was named (a
    transformers model's tokenizer: its folder was checked at the start, mixprec.models.hf_folder)."""

    def __init__(self, name: str, flag: str | None = None):
        from transformers import AutoTokenizer

        from ..models.hf_folder import remote_code

        try:
            self.tok = AutoTokenizer.from_pretrained(name, **remote_code())
        except Exception as err:  # noqa: BLE001  (offline, a wrong name, a broken folder; `tokenizers` raises Exception)
            said = " ".join(str(err).split())[:120]
            what = f"({type(err).__name__}{': ' + said if said else ''})"
            if flag:
                raise UsageError(f"{flag} {name}: its tokenizer could not be loaded {what}: repair the tokenizer's "
                                 f"files, or give another with --tokenizer_name FOLDER") from None
            raise UsageError(f"tokenizer '{name}' could not be loaded {what}: check the name, or the network (it is "
                             f"downloaded once), or use --dataset_args tokenizer=bytes") from None
        self.name, self.vocab_size, self.eos_token_id = name, len(self.tok), self.tok.eos_token_id

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def tokenizer(name: str, flag: str | None = None):
    return ByteTokenizer() if name == "bytes" else HFTokenizer(name, flag)


def hf_flag(cfg: ModelSettings) -> str | None:
    """The transformers flag that names the tokenizer of this run's model (None: not a transformers model's)."""
    if cfg.tokenizer_name:
        return "--tokenizer_name"
    return "--model_name_or_path" if cfg.model_name_or_path else None


def block_size_for(cfg: ModelSettings, requested: int | None) -> int:
    """The model's context length, or a shorter one asked for with --dataset_args block_size=N."""
    from .. import models

    context = models.setting(cfg.model, cfg.model_args, "block_size")
    if context is None:
        raise UsageError(f"--model {cfg.model} does not read text: use a gpt model (e.g. --model gpt_tiny)")
    if requested is not None and not 1 <= requested <= context:
        raise UsageError(f"--dataset_args block_size={requested} must be between 1 and the model's context "
                         f"{context} (--model_args block_size=N)")
    return requested or context


def prepare(parts: DatasetDict, cfg: ModelSettings, args: dict, text_column: str = "text", origin: str | None = None,
            shown: dict[str, str] | None = None) -> DataBundle:
    """{train, validation} documents -> blocks of token ids, `inputs` and `labels` (block_size each). `origin`:
    where the validation documents come from, for the banner; `shown`: how an error names a split's text
    ({"validation": "--validation_file 'v.txt'"}; default "the validation text")."""
    tok, block = tokenizer(args["tokenizer"], hf_flag(cfg)), block_size_for(cfg, args["block_size"])
    dtype = np.uint8 if tok.vocab_size <= 256 else np.uint16 if tok.vocab_size <= 65536 else np.int32

    def to_blocks(batch):
        eos = [np.asarray([tok.eos_token_id])] if tok.eos_token_id is not None and args["separate_rows"] else []
        pieces = [part for doc in batch[text_column] for part in (tok.encode(doc), *eos)]
        ids = np.concatenate(pieces).astype(dtype) if pieces else np.zeros(0, dtype)
        n = max(0, (len(ids) - 1) // block)  # blocks of block + 1 tokens, overlapping by one
        stream = ids[: n * block + 1]
        starts = np.arange(n) * block
        windows = stream[starts[:, None] + np.arange(block + 1)] if n else np.zeros((0, block + 1), dtype)
        return {"inputs": windows[:, :-1], "labels": windows[:, 1:]}

    mapped = {split: ds.map(to_blocks, batched=True, batch_size=1000, remove_columns=ds.column_names,
                            desc=f"tokens ({split}, {tok.name}, block {block})")
              for split, ds in parts.items()}
    train, val = mapped["train"], mapped["validation"]
    if args["max_val_samples"] is not None and len(val) > args["max_val_samples"]:
        val = val.select(range(args["max_val_samples"]))
        origin = origin and f"{origin}, its first {len(val):,} blocks (--dataset_args max_val_samples)"
    for name, ds in (("training", train), ("validation", val)):
        if len(ds) == 0:
            smaller = "--block_size" if cfg.model.startswith("hf_") else "--dataset_args block_size"
            raise UsageError(f"{(shown or {}).get(name, f'the {name} text')} is shorter than one block of {block + 1} "
                             f"tokens: give more text or a smaller {smaller}")
    info = {"task": "language_modeling", "vocab_size": tok.vocab_size, "block_size": block, "tokenizer": tok.name}
    if origin:
        info["validation_from"] = origin
    return DataBundle(train, val, info, decode=tok.decode, encode=tok.encode)


def stdlib_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py")
                  if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]) and p.is_file())


def in_validation(relative_path: str, val_fraction: float) -> bool:
    return zlib.crc32(relative_path.encode()) / 2**32 < val_fraction


@register("stdlib", TEXT_ARGS)
def stdlib(data: DataSettings, cfg: ModelSettings, seed: int) -> DataBundle:
    a = _args(data)
    if not 0 < a["val_fraction"] < 1:
        raise UsageError(f"val_fraction={a['val_fraction']} must be between 0 and 1")
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    if not files:
        raise UsageError(f"no standard library sources under {root}: use another --dataset")
    rel = [p.relative_to(root).as_posix() for p in files]
    key = f"{sys.version}|{root}|{a['val_fraction']}|" + "|".join(f"{r}:{p.stat().st_size}" for r, p in zip(rel, files))

    def make():
        split = {"train": {"path": [], "text": []}, "validation": {"path": [], "text": []}}
        for r, p in zip(rel, files):
            part = split["validation" if in_validation(r, a["val_fraction"]) else "train"]
            part["path"].append(r)
            part["text"].append(p.read_text(encoding="utf-8", errors="replace"))
        return DatasetDict({k: Dataset.from_dict(v) for k, v in split.items()})

    origin = f"files whose path hash falls in the first {share(a['val_fraction'])} (--dataset_args val_fraction)"
    return prepare(cached("stdlib", key, make), cfg, a, origin=origin)


def tail_split(ds: Dataset, val_fraction: float) -> DatasetDict:
    """The last `val_fraction` of the rows is validation: in order, so no text is on both sides."""
    if not 0 < val_fraction < 1:
        raise UsageError(f"val_fraction={val_fraction} must be between 0 and 1")
    cut = len(ds) - max(1, round(len(ds) * val_fraction))
    return DatasetDict(train=ds.select(range(cut)), validation=ds.select(range(cut, len(ds))))


@register("text", {**TEXT_ARGS, "separate_rows": Setting(False, bool)})  # rows are lines
def local_text(data: DataSettings, cfg: ModelSettings, seed: int) -> DataBundle:
    """--train_file's lines; validation: --validation_file's (a .txt file or folder too), else the last lines."""
    a = _args(data)
    path = _local_path(data, "a .txt file or a folder of them")
    val_path = validation_file(data)
    source = named("--train_file", data.train_file)
    train = Dataset.from_dict({"text": _lines(path, source)})
    if val_path is None:
        if len(train) < 2:
            raise UsageError(f"{source} has {'no text' if len(train) == 0 else 'one line'}: give a text with lines "
                             f"for training and for validation")
        origin = f"the last {share(a['val_fraction'])} of --train_file's lines (--dataset_args val_fraction)"
        return prepare(tail_split(train, a["val_fraction"]), cfg, a, origin=origin)
    val_source = named("--validation_file", data.validation_file)
    validation = Dataset.from_dict({"text": _lines(val_path, val_source)})
    for ds, shown in ((train, source), (validation, val_source)):
        if len(ds) == 0:
            raise UsageError(f"{shown} has no text: give a UTF-8 text file or a folder of them")
    return prepare(DatasetDict(train=train, validation=validation), cfg, a, origin=val_source,
                   shown={"training": source, "validation": val_source})


def _lines(path: Path, source: str) -> list[str]:
    """The lines of a .txt file, or of every .txt file in a folder (in the order of their paths as strings)."""
    files = [Path(p) for p in sorted(str(p) for p in path.rglob("*.txt"))] if path.is_dir() else [path]
    if not files:
        raise UsageError(f"{source} holds no .txt files: give a .txt file or a folder of them")
    return [line for name in files for line in _read_text(name, source)]


def _read_text(path: Path, source: str) -> list[str]:
    """The lines of a UTF-8 text file, line breaks kept; read directly, so that its name is taken literally.
    `source`: how errors name the flag and its value (checks.named)."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise preflight.explain(err, source.split(" ", 1)[0], path) from None  # the flag, and the file in it
    nul = raw.find(b"\0")
    if nul >= 0:
        raise UsageError(f"{source}: '{path}' holds binary data (a NUL byte at offset {nul}): give a text file")
    try:
        return raw.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError as err:
        raise UsageError(f"{source}: '{path}' is not UTF-8 text (byte {raw[err.start]:#04x} at offset {err.start}): "
                         f"save it as UTF-8") from None


@register("random_tokens", RANDOM_TOKENS)
def random_tokens(data: DataSettings, cfg: ModelSettings, seed: int) -> DataBundle:
    """Uniformly random token ids: nothing to learn or download, any vocabulary size. For throughput and
    memory benchmarks of a language model at its real size (e.g. GPT-2's 50,257 tokens, padded to 50,304)."""
    a = _args(data)
    block = block_size_for(cfg, a["block_size"])
    rng = np.random.default_rng(1234)
    dtype = np.uint16 if a["vocab_size"] <= 65536 else np.int32
    preflight.require_memory((a["num_samples"] + a["num_val"]) * (block + 1) * 16, f"--dataset_args num_samples="
                             f"{a['num_samples']}, num_val={a['num_val']} (blocks of {block} tokens)",
                             "give fewer samples")

    def split(n):
        ids = rng.integers(0, a["vocab_size"], (n, block + 1)).astype(dtype)
        return Dataset.from_dict({"inputs": ids[:, :-1], "labels": ids[:, 1:]})

    info = {"task": "language_modeling", "vocab_size": a["vocab_size"], "block_size": block, "tokenizer": "random",
            "validation_from": "seeded random tokens (--dataset_args num_val)"}
    return DataBundle(split(a["num_samples"]), split(a["num_val"]), info)  # no decode: nothing to sample
