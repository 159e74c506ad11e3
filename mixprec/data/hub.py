"""Datasets from the Hugging Face Hub: `--dataset hub --dataset_name NAME [--dataset_config CONFIG]`.

The columns say what the dataset is: one with the `Image` feature makes it an image classification dataset
(mnist, cifar10, fashion_mnist, ...; pipeline in images.py), else a text column (`text`, or
`--dataset_args text_column=NAME`) makes it text for language models (wikitext, tiny_shakespeare, ...;
pipeline in text.py). The dataset's validation split is used (or 'valid', 'val'), else its test split, else
a seeded share of train (val_fraction); the banner's validation line says which. Downloads are cached by
`datasets` (HF_DATASETS_CACHE); an unreachable Hub or an unknown name is a one-line error.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from datasets import DatasetDict, Image, load_dataset

from ..errors import UsageError
from ..typed_args import Setting, fraction, positive
from . import DataBundle, _args, register
from .images import prepare as prepare_images
from .images import validation_split
from .text import TEXT_ARGS
from .text import prepare as prepare_text

if TYPE_CHECKING:
    from ..config.sections import DataSettings, ModelSettings

HUB_ARGS = {**TEXT_ARGS, "val_fraction": fraction(0.05), "image_size": positive(None, optional=True),
            "image_column": Setting(None, str, optional=True), "label_column": Setting(None, str, optional=True),
            "text_column": Setting("text", str)}


def load(name: str, config: str | None) -> DatasetDict:
    """load_dataset with every failure (offline, unknown name, missing config) as one line."""
    from huggingface_hub.utils import logging as hub_logging

    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()  # its retry warnings would bury the one line below
    try:
        parts = load_dataset(name, config)
    except Exception as err:  # noqa: BLE001  (ConnectionError, DatasetNotFoundError, ValueError, ...)
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise UsageError(f"could not load '{name}'{f' ({config})' if config else ''} from the Hugging Face Hub: "
                         f"{type(err).__name__}: {first} -- check the name and --dataset_config, and that this "
                         f"machine can reach the Hub (or use an offline dataset: digits, stdlib)") from None
    finally:
        hub_logging.set_verbosity(verbosity)
    if not isinstance(parts, DatasetDict):
        parts = DatasetDict(train=parts)
    return parts


@register("hub", HUB_ARGS)
def hub(data: DataSettings, cfg: ModelSettings, seed: int) -> DataBundle:
    a = _args(data)
    if not data.dataset_name:
        raise UsageError("--dataset hub needs --dataset_name NAME (e.g. mnist, cifar10, or wikitext with "
                         "--dataset_config wikitext-2-raw-v1)")
    parts, origin = validation_split(load(data.dataset_name, data.dataset_config), a["val_fraction"],
                                     of=f"--dataset_name '{data.dataset_name}'")
    features = parts["train"].features
    if a["image_column"] or any(isinstance(f, Image) for f in features.values()):
        return prepare_images(parts, a["image_size"], a["image_column"], a["label_column"], origin=origin)
    if a["text_column"] not in features:
        raise UsageError(f"'{data.dataset_name}' has no image column and no text column '{a['text_column']}' "
                         f"(columns: {', '.join(features)}): name one with --dataset_args text_column=NAME")
    text_args = {k: a[k] for k in TEXT_ARGS}
    return prepare_text(parts, cfg, text_args, text_column=a["text_column"], origin=origin)
