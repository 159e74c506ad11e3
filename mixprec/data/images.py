"""Images: scikit-learn's handwritten digits (offline default), local image folders, and the common
pipeline that Hub image datasets (mnist, cifar10, ...) also go through (hub.py).

Every image dataset becomes an HF dataset with an `Image` column and an integer label column; `prepare`
then maps it (cached) to `inputs`: uint8 pixels (C, H, W), resized to `image_size` when one is given, and
`labels`. The models normalise the pixels themselves with the per-channel mean and std of the training
images, which are in `info` (so the saved weights take raw pixels).

- digits: the 1,797 8x8 digits that ship inside scikit-learn (`sklearn.datasets.load_digits`), values 0-16.
  They are scaled to 0-255 and resized (bilinear) to 32x32, the size the small ResNet is built for and that
  of CIFAR-10, so that throughput and memory are those of a 32-px dataset. `--dataset_args image_size=8`
  trains on the original pixels. 20% are held out for validation (seeded split).
- imagefolder: `--train_file DIR` with one sub-folder per class, read by name (`read_folder`); validation is
  `--validation_file DIR` of class sub-folders (only classes the training folder has; labels by folder name),
  else the folder's validation/ (or test/) sub-folder when it has train/, else a seeded share.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from pathlib import Path

from datasets import ClassLabel, Dataset, DatasetDict, Features, Image

from ..errors import UsageError
from ..typed_args import fraction, positive
from . import DataBundle, _args, _local_path, _split, cached, register
from .checks import named, share, validation_file

if TYPE_CHECKING:
    from ..config.sections import DataSettings, ModelSettings

MAX_STATS_IMAGES = 10_000  # mean and std come from the first images of the training split


def _columns(ds: Dataset, image_column: str | None, label_column: str | None) -> tuple[str, str]:
    """The image column (the first `Image` feature) and the label column (the first ClassLabel, else 'label')."""
    feats = ds.features
    image = image_column or next((n for n, f in feats.items() if isinstance(f, Image)), None)
    label = label_column or next((n for n, f in feats.items() if isinstance(f, ClassLabel)), None)
    label = label or next((n for n in ("label", "labels") if n in feats), None)
    for what, name, key in (("image", image, "image_column"), ("label", label, "label_column")):
        if name is None or name not in feats:
            raise UsageError(f"no {what} column {name or ''} among {', '.join(feats)}: "
                             f"name it with --dataset_args {key}=NAME")
    return image, label


def _pixels(images, size: int | None) -> np.ndarray:
    """PIL images -> uint8 array (N, C, H, W); grayscale stays 1 channel, anything else becomes RGB."""
    from PIL import Image as PILImage

    mode = "L" if all(im.mode in ("L", "1", "I", "I;16", "F") for im in images) else "RGB"
    out = []
    for im in images:
        im = im.convert(mode)
        if size and im.size != (size, size):
            im = im.resize((size, size), PILImage.BILINEAR)
        arr = np.asarray(im, dtype=np.uint8)
        out.append(arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1))
    shapes = {a.shape for a in out}
    if len(shapes) > 1:
        raise UsageError(f"images of different sizes {sorted(shapes)[:2]}: give one size with "
                         f"--dataset_args image_size=32")
    return np.stack(out)


def prepare(parts: DatasetDict, image_size: int | None = None, image_column: str | None = None,
            label_column: str | None = None, origin: str | None = None,
            shown: str = "the validation images") -> DataBundle:
    """{train, validation} with an image and a label column -> uint8 `inputs` (C, H, W) and `labels`. `origin`:
    where the validation images come from, for the banner; `shown`: how an error names them."""
    image, label = _columns(parts["train"], image_column, label_column)
    feature = parts["train"].features[label]
    names = feature.names if isinstance(feature, ClassLabel) else None

    def to_arrays(batch):
        return {"inputs": _pixels(batch[image], image_size), "labels": np.asarray(batch[label], dtype=np.int64)}

    mapped = {split: ds.map(to_arrays, batched=True, batch_size=256, remove_columns=ds.column_names,
                            desc=f"images ({split})")
              for split, ds in parts.items()}
    train = mapped["train"].with_format("numpy")
    sample = train.select(range(min(len(train), MAX_STATS_IMAGES)))[:]["inputs"].astype(np.float64) / 255
    mean, std = sample.mean(axis=(0, 2, 3)), sample.std(axis=(0, 2, 3))
    num_classes = len(names) if names else int(train[:]["labels"].max()) + 1
    _same_shape(sample.shape[1:], mapped["validation"], shown)
    info = {"task": "image_classification", "image_shape": list(sample.shape[1:]), "num_classes": num_classes,
            "mean": [round(float(m), 6) for m in mean], "std": [round(float(max(s, 1e-6)), 6) for s in std],
            "class_names": names}
    if origin:
        info["validation_from"] = origin
    return DataBundle(mapped["train"], mapped["validation"], info)


def _same_shape(shape: tuple, validation: Dataset, shown: str) -> None:
    """The validation images have the training images' channels and size (a model is built for one)."""
    if not len(validation):
        return
    theirs = validation.with_format("numpy").select(range(1))[:]["inputs"].shape[1:]
    if tuple(theirs) != tuple(shape):
        raise UsageError(f"{shown} are {'x'.join(map(str, theirs))} (channels x height x width), the training images "
                         f"{'x'.join(map(str, shape))}: give images of one size and colour mode (--dataset_args "
                         f"image_size=N resizes both)")


@register("digits", {"image_size": positive(32, optional=True), "val_fraction": fraction(0.2)})
def digits(data: DataSettings, cfg: ModelSettings, seed: int) -> DataBundle:
    a = _args(data)

    def make():
        from PIL import Image as PILImage
        from sklearn.datasets import load_digits

        raw = load_digits()
        pixels = np.round(raw.images * (255 / 16)).astype(np.uint8)  # 0..16 -> 0..255
        return Dataset.from_dict({"image": [PILImage.fromarray(p, mode="L") for p in pixels],
                                  "label": raw.target.astype(np.int64)},
                                 features=Features({"image": Image(), "label": ClassLabel(num_classes=10)}))

    import sklearn

    ds = cached("digits", f"sklearn-{sklearn.__version__}", make)
    parts = _split(ds, a["val_fraction"], seed=1234)
    return prepare(DatasetDict(train=parts["train"], validation=parts["test"]), a["image_size"],
                   origin=f"a seeded {share(a['val_fraction'])} share (--dataset_args val_fraction)")


def with_validation(parts: DatasetDict, val_fraction: float, seed: int = 1234) -> DatasetDict:
    """The dataset's own validation (or test) split, else a seeded share of the training split."""
    return validation_split(parts, val_fraction, seed)[0]


def validation_split(parts: DatasetDict, val_fraction: float, seed: int = 1234,
                     of: str = "the dataset") -> tuple[DatasetDict, str]:
    """with_validation's {train, validation}, and where validation came from, for the banner ("the test split
    of --dataset_name 'mnist'"; `of` names the data)."""
    if "train" not in parts:
        raise UsageError(f"the dataset has no 'train' split (it has {', '.join(parts)})")
    for name in SPLITS[1:]:
        if name in parts:
            return DatasetDict(train=parts["train"], validation=parts[name]), f"the {name} split of {of}"
    split = _split(parts["train"], val_fraction, seed)
    return (DatasetDict(train=split["train"], validation=split["test"]),
            f"a seeded {share(val_fraction)} share of the train split of {of} (--dataset_args val_fraction)")


@register("imagefolder", {"image_size": positive(None, optional=True), "val_fraction": fraction(0.2)})
def imagefolder(data: DataSettings, cfg: ModelSettings, seed: int) -> DataBundle:
    """--train_file DIR of class sub-folders (or train/ and validation/ or test/ holding them); validation:
    --validation_file DIR of class sub-folders, else the folder's own validation/ (or test/), else a share."""
    a = _args(data)
    path = _local_path(data, "a folder with one sub-folder of images per class")
    val_path = validation_file(data)
    source = named("--train_file", data.train_file)
    for folder, shown in ((path, source), (val_path, named("--validation_file", data.validation_file))):
        if folder is not None and not folder.is_dir():
            raise UsageError(f"{shown} must be a folder with one sub-folder of images per class")
    parts = read_folder(path, data.train_file)
    if val_path is None:
        own = next((name for name in SPLITS[1:] if name in parts), None)
        origin = (f"the folder's {own}/ sub-folder" if own else
                  f"a seeded {share(a['val_fraction'])} share of --train_file's images (--dataset_args val_fraction)")
        return prepare(with_validation(parts, a["val_fraction"]), a["image_size"], origin=origin)
    val_source = named("--validation_file", data.validation_file)
    if set(parts) != {"train"}:
        own = sorted(set(parts) - {"train"})[0]
        raise UsageError(f"{source} has its own {own}/ sub-folder and {val_source} is given: drop --validation_file, "
                         f"or give {named('--train_file', Path(data.train_file) / 'train')}")
    classes = parts["train"].features["label"].names
    validation = read_folder(val_path, data.validation_file, "--validation_file", classes=(classes, source))
    parts = DatasetDict(train=parts["train"], validation=validation["train"])
    return prepare(parts, a["image_size"], origin=val_source, shown=f"the images of {val_source}")


SPLITS = ("train", "validation", "valid", "val", "test")
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def read_folder(path: Path, shown: str, flag: str = "--train_file",
                classes: tuple[list[str], str] | None = None) -> DatasetDict:
    """One sub-folder of images per class (or train/ and validation/ or test/ holding those), read by name, not
    as a glob pattern (a folder named 'imgs [1]' is that folder); every image is opened and decoded here, so a
    truncated or unreadable one is one line naming it. `shown` is the folder as the user gave it to `flag`.
    `classes`: (the training folder's classes, its source) for a validation folder, which may hold only those
    (labels are by folder name) and no split sub-folders: it is returned as the 'train' split of its own."""
    source = named(flag, shown)
    top = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    splits = {p.name: p for p in top if p.name in SPLITS} if any(p.name == "train" for p in top) else {"train": path}
    if classes is not None and splits != {"train": path}:  # a validation folder is one split
        raise UsageError(f"{source} holds split sub-folders ({', '.join(sorted(splits))}): give the folder of class "
                         f"sub-folders itself, e.g. {named(flag, Path(shown) / 'validation')}")
    found = sorted({c.name for folder in splits.values() for c in folder.iterdir()
                    if c.is_dir() and not c.name.startswith(".")})
    if not found:
        raise UsageError(f"{source} has no sub-folders of images: give one folder per class")
    if classes is not None:
        _known_classes(found, *classes, source)
    names = classes[0] if classes is not None else found
    features = Features({"image": Image(), "label": ClassLabel(names=names)})
    out = {}
    for split, folder in splits.items():
        files, labels = [], []
        for label, name in enumerate(names):
            for image in _images(folder / name) if (folder / name).is_dir() else []:
                _decodes(image, path, source)
                files.append(str(image))
                labels.append(label)
        out[split] = Dataset.from_dict({"image": files, "label": labels}, features=features)
    if not len(out["train"]):
        raise UsageError(f"{source} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))}): add some")
    return DatasetDict(out)


def _known_classes(found: list[str], known: list[str], train_source: str, source: str) -> None:
    """A validation folder's classes are among the training folder's."""
    only = [c for c in found if c not in known]
    if only:
        raise UsageError(f"{source} has the class folder '{only[0]}', which {train_source} does not have (its "
                         f"classes: {', '.join(known[:10])}{', ...' if len(known) > 10 else ''}): a class only in "
                         f"validation cannot be learnt: give both folders the same class sub-folders")


def _decodes(image: Path, root: Path, source: str) -> None:
    """Open and decode `image` (under `root`), or one line naming it."""
    from PIL import Image as PILImage

    try:
        with PILImage.open(image) as im:
            im.load()
    except Exception as err:  # noqa: BLE001  (PIL's errors for cut-short or foreign files vary)
        said = str(err).splitlines()[0][:120] if str(err) else "damaged"
        raise UsageError(f"{source}: the image '{image.relative_to(root)}' cannot be read ({type(err).__name__}: "
                         f"{said}): replace or remove it") from None
