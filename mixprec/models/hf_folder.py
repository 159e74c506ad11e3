"""A transformers model folder, checked at the start of a run (`hf_flags.apply`) before anything is loaded, so that a
damaged one is one line naming the flag, the folder, the file and the fix (exit code 2, nothing on disk changed):

- config.json (`model_config`): a JSON object with a `model_type` this transformers knows (or classes of its own
  in `auto_map`, run only with --trust_remote_code: without it, one line naming the flag), that
  `AutoConfig.from_pretrained` builds (its own checks: a head count that divides the hidden size, the fields'
  types), with positive sizes, of an architecture the task can use (a causal-LM class for the text datasets, and
  not an encoder, which would see the tokens it predicts; a sequence-classification class for
  --dataset text_classification), and that builds a model on torch's meta device (no memory, no weights read);
- the weights (`weights`): each .safetensors header read with `safetensors.safe_open` (mmap, the header only): whole,
  valid, and describing exactly the bytes the file holds (a truncated file is refused); with
  model.safetensors.index.json, every shard it names present and holding the tensors it puts there;
- the tokenizer (`tokenizer`): some tokenizer file present, and its JSON files JSON objects.

What only the loading can find (the weights' shapes against config.json, weights the checkpoint lacks, NaN or inf
in them) is refused by `mixprec.models.hf._load`.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from ..errors import UsageError

# sizes a config names (GPT-2's names too): a zero or negative one describes no model (null is the default)
SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "intermediate_size", "max_position_embeddings", "head_dim", "n_embd", "n_layer", "n_head", "n_inner",
         "n_positions", "n_ctx", "d_model", "num_layers", "num_heads", "d_ff", "d_kv", "num_labels")
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.model", "tokenizer_config.json")
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                  "vocab.json")
FIX = "repair it, or copy the folder again from where the model was saved"
REMOTE_CODE = {"trusted": False}  # --trust_remote_code of the settings parsed last: hf_flags.apply sets it
BAR_BYTES = 2**30  # a checkpoint this large loads with transformers' progress bar; a smaller one in a second


@contextlib.contextmanager
def quiet_transformers(bar: bool = True):
    """transformers' warnings off while a folder is checked or loaded: a refused folder is one line, not its log
    first; without `bar`, its loading bar off too."""
    from transformers.utils import logging

    verbosity, shown = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    if not bar:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if shown:
            logging.enable_progress_bar()


def remote_code() -> dict:
    """The keyword every from_pretrained / from_config of a transformers model, config or tokenizer gets: off unless
    --trust_remote_code (and said: left unsaid, transformers would ask on a terminal)."""
    return {"trust_remote_code": REMOTE_CODE["trusted"]}


def refused_code(where: str, auto_map) -> UsageError:
    """A model whose config.json names classes of its own (auto_map) that run only with --trust_remote_code."""
    named = ", ".join(sorted(auto_map)) if isinstance(auto_map, dict) else "its own classes"
    return UsageError(f"{where} names Python code of its own (auto_map: {named}), which transformers runs only "
                      f"with --trust_remote_code: add the flag if you trust that code (off by default)")


def large(source: str) -> bool:
    """Whether a checkpoint is worth a loading bar: a Hub id (downloaded), or a folder of BAR_BYTES of weights."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        return True
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".safetensors", ".bin")) >= BAR_BYTES


def unreadable(flag: str, value: str, path: Path, err: OSError) -> UsageError:
    """A file of the folder that exists but cannot be read."""
    return UsageError(f"{flag} {value}: {path.name} cannot be read ({err.strerror or type(err).__name__}): check "
                      f"its permissions and the disk")


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:160]}" + ("..." if len(text) > 160 else "")


def model_config(flag: str, value: str, raw: dict, source: str, classify: bool):
    """The transformers config of `raw` (config.json of `source`: a local folder, or a Hub id's, downloaded),
    checked; UsageError."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import CONFIG_MAPPING, AutoConfig

    where = f"{flag} {value}: config.json"
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UsageError(f"{where} has no model_type (e.g. \"llama\"): {FIX} (save_pretrained writes it)")
    own = raw.get("auto_map") if model_type not in CONFIG_MAPPING else None  # a model with code of its own
    if own and not REMOTE_CODE["trusted"]:
        raise refused_code(where, own)
    if model_type not in CONFIG_MAPPING and not own:
        raise UsageError(f"{where} has model_type {model_type!r}, which this transformers does not know: fix "
                         f"model_type, or upgrade transformers for a newer architecture")
    for key in SIZES:
        size = raw.get(key)
        if isinstance(size, int) and not isinstance(size, bool) and size <= 0:
            raise UsageError(f"{where} has {key} {size}: sizes must be positive: {FIX}")
    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(source, **remote_code())
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ArithmeticError, StrictDataclassError) as err:
        if "trust_remote_code" in str(err):
            raise refused_code(where, raw.get("auto_map")) from None
        raise UsageError(f"{where} is refused by transformers ({_first_line(err)}): {FIX}") from None
    _dtype(where, config)
    _task(where, model_type, config, classify, own)
    try:
        with quiet_transformers():
            meta_model(config, classify)
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError, ArithmeticError) as err:
        raise UsageError(f"{where} describes a {model_type} model transformers cannot build ({_first_line(err)}): "
                         f"{FIX}") from None
    return config


_META: dict = {}  # the last model built on the meta device, by its config: the start's checks build it again


def meta_model(config, classify: bool = False):
    """The model of transformers `config` on torch's meta device: no memory, no weights read."""
    import torch
    import transformers

    from .. import compat

    key = (classify, config.to_json_string())
    if key not in _META:
        auto = "AutoModelForSequenceClassification" if classify else "AutoModelForCausalLM"
        with torch.device("meta"), compat.whole_weights_under_zero3():  # a plain module, whatever the engine
            model = getattr(transformers, auto).from_config(config, dtype=torch.float32, **remote_code())
        _META.clear()
        _META[key] = model
    return _META[key]


def _dtype(where: str, config) -> None:
    """The dtype the checkpoint says it stores: a floating torch dtype, or none."""
    import torch

    dtype = getattr(config, "dtype", None)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise UsageError(f"{where} has dtype {dtype!r}, not a floating-point dtype (float32, bfloat16, float16): "
                         f"{FIX}")


def _task(where: str, model_type: str, config, classify: bool, own: dict | None = None) -> None:
    from transformers.models.auto import modeling_auto as auto

    if own:  # code of its own (--trust_remote_code): its auto_map names the class the task needs
        need = "AutoModelForSequenceClassification" if classify else "AutoModelForCausalLM"
        if need not in own:
            raise UsageError(f"{where}: its auto_map names no {need} ({', '.join(sorted(own))}): give a model with "
                             f"one for {'--dataset text_classification' if classify else 'the text datasets'}")
        return
    if classify:
        if model_type not in auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
            raise UsageError(f"{where}: a {model_type} model has no sequence-classification class in transformers: "
                             f"give a model with one (bert, llama, ...) for --dataset text_classification")
        return
    if model_type not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(f"{where}: a {model_type} model has no causal-LM class in transformers: give a causal LM "
                         f"(llama, gpt2, ...), or --dataset text_classification for a classifier")
    encoder = (model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
               and model_type not in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    if encoder and not (getattr(config, "is_decoder", False) or getattr(config, "causal", False)):
        raise UsageError(f"{where}: a {model_type} model is an encoder: trained as a causal LM it would see the "
                         f"tokens it predicts (config.json has no \"is_decoder\": true): give a causal LM (llama, "
                         f"gpt2, ...), or --dataset text_classification to classify with it")


def weights(flag: str, value: str, folder: Path) -> None:
    """The checkpoint's safetensors files, read as far as their headers (UsageError). A torch pickle
    (pytorch_model.bin) is left to the loader."""
    if (folder / "model.safetensors").is_file():  # the order in which from_pretrained looks
        _header(flag, value, folder / "model.safetensors")
    elif (folder / "model.safetensors.index.json").is_file():
        _shards(flag, value, folder, folder / "model.safetensors.index.json")
    elif not any((folder / name).is_file() for name in WEIGHTS):
        raise UsageError(f"{flag} {value} holds no weights ({', '.join(WEIGHTS)}): give a folder saved with "
                         f"save_pretrained, or --config_name {value} --tokenizer_name {value} for fresh weights")
    json_objects(flag, value, folder, ("generation_config.json",))  # the export ships it: never a silent default


def _header(flag: str, value: str, path: Path) -> set[str]:
    """The tensor names of a safetensors file whose header is whole and describes exactly the bytes it holds."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return set(f.keys())
    except SafetensorError as err:
        problem = str(err).removeprefix("Error while deserializing header: ")
        raise UsageError(f"{flag} {value}: {path.name} is damaged ({problem}; {path.stat().st_size:,} bytes): "
                         f"copy it again from where the model was saved") from None
    except OSError as err:
        raise unreadable(flag, value, path, err) from None


def _shards(flag: str, value: str, folder: Path, index: Path) -> None:
    try:
        weight_map = json.loads(index.read_bytes()).get("weight_map")
    except (ValueError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise UsageError(f"{flag} {value}: {index.name} is damaged (not a JSON object with a weight_map of tensor "
                         f"names to shard files): {FIX}")
    by_shard: dict[str, list[str]] = {}
    for tensor, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(tensor)
    for shard, tensors in sorted(by_shard.items()):
        path = folder / shard
        if Path(shard).name != shard or not path.is_file():
            raise UsageError(f"{flag} {value}: the shard {shard!r} that {index.name} names is missing: copy the "
                             f"whole folder again from where the model was saved")
        missing = sorted(set(tensors) - _header(flag, value, path))
        if missing:
            raise UsageError(f"{flag} {value}: {index.name} puts {len(missing)} tensor(s) in {shard} that it does "
                             f"not hold ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): {FIX}")


def tokenizer(flag: str, value: str, folder: Path) -> None:
    """A tokenizer file present, and each of the tokenizer's JSON files a JSON object (UsageError)."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(f"{flag} {value} has no tokenizer ({', '.join(TOKENIZER_FILES[:4])}, ...): save the "
                         f"tokenizer there with save_pretrained, or give --tokenizer_name FOLDER")
    json_objects(flag, value, folder, TOKENIZER_JSON)


def json_objects(flag: str, value: str, folder: Path, names) -> None:
    """Each of the files `names` in `folder` that exists is a JSON object (UsageError)."""
    for name in names:
        path = folder / name
        if not path.is_file():
            continue
        try:
            ok = isinstance(json.loads(path.read_bytes()), dict)
        except ValueError as err:  # not UTF-8, not JSON
            raise UsageError(f"{flag} {value}: {name} is not valid JSON ({_first_line(err)}): {FIX}") from None
        except OSError as err:
            raise unreadable(flag, value, path, err) from None
        if not ok:
            raise UsageError(f"{flag} {value}: {name} is not a JSON object: {FIX}")
