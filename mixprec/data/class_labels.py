"""The classes of a text-classification dataset (`--dataset text_classification`) and the head they take, as
transformers' run_glue.py decides them for its own files:

- class names (a label column of words, "pos"/"neg"): the training rows' names sorted, numbered 0..C-1
  (run_glue.py: `label_list = sorted(train.unique("label"))`, `label_to_id = {v: i ...}`); a validation name that
  no training row has is refused, naming where it is. The names become the export's `id2label`/`label2id`. A
  fine-tuned checkpoint whose config.json names its classes (id2label other than LABEL_i) with the data's names
  (compared without case, as run_glue.py lowercases them) keeps its numbering: its head's outputs stay the classes
  they were trained for (run_glue.py: `label_to_id = {i: label_name_to_id[label_list[i]]}`).
- class numbers (integers): kept as they are (run_glue.py renumbers them too, 0, 2, 5 -> 0, 1, 2; here a number
  is a class of the checkpoint's head, and a renumbering would silently move it), checked: none negative, none
  far apart (more unused numbers below the highest than classes found, and more than SPARE_CLASSES: 0, 1000000,
  2000000 would take a head of 2,000,001 outputs). A dataset's `ClassLabel` feature gives their names (GLUE's).
- the head's size (`num_labels`): --num_labels where given (refused when it is fewer than the classes found),
  else the data's: the number of names, or the highest class number + 1, or the checkpoint's head where that is
  larger (class numbers are the checkpoint's classes: a 3-class head fine-tuned on rows of 0 and 1 is kept).
- training rows of a single class are refused (a classifier that cannot fail).
The mapping comes from the training rows alone, which the resume contract fingerprints (--train_file,
--validation_file): a resume maps the same names to the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UsageError

SPARE_CLASSES = 8  # unused class numbers allowed below the highest (or one per class found, if more)
SHOWN = 5  # values listed in a message


@dataclass
class Classes:
    num_labels: int  # the head's outputs
    names: list[str] | None  # class names in id order where the labels are words (mapped), else None
    id2label: dict[int, str] | None  # for the model's config: the names (or a ClassLabel's); None: the checkpoint's
    order: str = ""  # how names were numbered: "class names, sorted" or "the checkpoint's id2label"


def listed(values, shown: int = SHOWN) -> str:
    values = list(values)
    return ", ".join(map(repr if values and isinstance(values[0], str) else str, values[:shown])) + (
        ", ..." if len(values) > shown else "")


def labels(ds, label: str) -> np.ndarray:
    return np.asarray(ds.with_format("numpy", columns=[label])[:][label])


def is_words(ds, label: str) -> bool:
    return getattr(ds.features[label], "dtype", None) in ("string", "large_string")


def first_rows(parts, label: str) -> dict:
    """{class: where it is first} of a loaded dataset's splits ('row 3 of its train split')."""
    seen: dict = {}
    for name, part in parts.items():
        values, first = np.unique(labels(part, label), return_index=True)
        for value, row in zip(values.tolist(), first.tolist()):
            seen.setdefault(value, f"row {row + 1} of its {name} split")
    return seen


def check_numbers(seen: dict[int, str], source: str) -> int:
    """The class numbers found (each with where it is first) checked: from 0, not so far apart that most outputs
    of the head would have no rows. Returns the outputs they take (the highest + 1)."""
    found = sorted(seen)
    low, high = found[0], found[-1]
    if low < 0:
        raise UsageError(f"{source} has the label {low} (on {seen[low]}): class numbers start at 0: give "
                         f"0..{high if high > 0 else len(found) - 1}")
    if high + 1 - len(found) > max(len(found), SPARE_CLASSES):
        raise UsageError(f"{source} has {len(found)} classes numbered up to {high} ({listed(found)}; {high} on "
                         f"{seen[high]}), which would take a classifier of {high + 1:,} outputs: number the "
                         f"classes 0..{len(found) - 1}")
    return high + 1


def decide(parts, label: str, given: int | None, checkpoint: int, source: str, numbers: dict | None,
           validation: dict, checkpoint_labels: list[str] | None = None) -> Classes:
    """The classes of `parts` (train and validation, their labels already checked to be numbers or words of one
    kind) and the head's size. `given`: --num_labels; `checkpoint`: the model's config.json num_labels;
    `numbers`: {class: where it is first} of the scanned files (None for a loaded dataset: found here);
    `validation`: {"source": what names the validation rows in a message, "rows": where they come from, "seen":
    {class: line} of a scanned --validation_file, or absent}; `checkpoint_labels`: the checkpoint's own class
    names in id order (None: it has none)."""
    if is_words(parts["train"], label):
        names = sorted(parts["train"].unique(label))
        _known(parts["validation"], label, names, validation)
        _enough(given, len(names), f"the {len(names)} classes of {source} ({listed(names)})")
        num, order = given or len(names), "class names, sorted"
        own = {name.lower(): i for i, name in enumerate(checkpoint_labels or ())}
        if len(own) == len(names) == num and sorted(own) == sorted(n.lower() for n in names):
            names, order = sorted(names, key=lambda n: own[n.lower()]), "the checkpoint's id2label"
        return Classes(num, names, {i: (names[i] if i < len(names) else f"LABEL_{i}") for i in range(num)}, order)
    seen = numbers if numbers is not None else first_rows(parts, label)
    needed = check_numbers(seen, source)
    feature = parts["train"].features[label]
    named = list(getattr(feature, "names", None) or [])  # a ClassLabel's names (GLUE's 'equivalent', ...)
    needed = max(needed, len(named))
    high = max(seen)
    _enough(given, needed, f"the classes of {source}: class numbers up to {high} (on {seen[high]}) take "
                           f"{needed} outputs")
    num = given or max(needed, checkpoint)
    id2label = {i: (named[i] if i < len(named) else f"LABEL_{i}") for i in range(num)} if named else None
    return Classes(num, None, id2label)


def _enough(given: int | None, needed: int, what: str) -> None:
    if given is not None and given < needed:
        raise UsageError(f"--num_labels {given} is fewer than {what}: give --num_labels {needed} or more, or drop it "
                         f"(the default is the data's {needed})")


def _known(table, label: str, names: list[str], validation: dict) -> None:
    """Every validation name is a training row's: a class the model never trains on cannot be learned."""
    unknown = sorted(set(table.unique(label)) - set(names))
    if not unknown:
        return
    name = unknown[0]
    seen = validation.get("seen") or {}
    where = (f"first on {seen[name]}" if name in seen else
             f"row {table[label].index(name) + 1} of the validation rows, {validation['rows']}")
    more = f" ({len(unknown)} such names: {listed(unknown)})" if len(unknown) > 1 else ""
    raise UsageError(f"{validation['source']}: the label {name!r} ({where}) is not among the training rows' labels "
                     f"({listed(names)}){more}: the model never trains on it: add training rows of it, or drop "
                     f"those validation rows")


def one_class(parts, label: str, source: str, tail: bool) -> None:
    """Training rows of one class only make a classifier that cannot fail (val accuracy 1.0 on that class)."""
    train = np.unique(labels(parts["train"], label))
    if len(train) != 1:
        return
    others = sorted(set(np.unique(labels(parts["validation"], label)).tolist()) - set(train.tolist()))
    hint = (f"; the others ({', '.join(map(str, others[:SHOWN]))}) are only in the validation rows"
            f"{' (the last rows of the file): shuffle the file' if tail else ''}" if others else
            ": add rows of the other classes")
    raise UsageError(f"{source}: every training row has the label {train[0]}: a classifier needs rows of two or "
                     f"more classes to learn anything{hint}")
