"""Checks of local data files before a run uses them: values that are not finite numbers (NaN, inf, empty
fields), JSON lines whose keys differ, too few rows to split, and a --validation_file that disagrees with
--train_file (other columns, a class only in validation). Each is one line naming the flag and file, the row
and the column, and the fix.

`source` in these functions is how the file is named in the line: `named("--train_file", value)`, or
`named("--validation_file", value)` for validation data read in --train_file's form."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import UsageError

if TYPE_CHECKING:
    from ..config.sections import DataSettings


def named(flag: str, value) -> str:
    """How a message names a file: "--train_file 'data.csv'"."""
    return f"{flag} '{value}'"


def share(fraction: float) -> str:
    """0.05 -> '5%', 0.125 -> '12.5%'."""
    return f"{fraction * 100:g}%"


def validation_file(data: DataSettings) -> Path | None:
    """--validation_file, checked to exist; None without it (validation is then a share of --train_file).
    --dataset_args val_fraction beside it is refused: no share is split off then, and a setting that does
    nothing would say otherwise."""
    from . import validation_path

    path = validation_path(data)
    if path is not None and "val_fraction" in (data.dataset_args or {}):
        raise UsageError(f"--dataset_args val_fraction={data.dataset_args['val_fraction']} sets the share of "
                         f"--train_file split off for validation, but {named('--validation_file', data.validation_file)}"
                         f" is the validation data (nothing is split off): drop one of them")
    return path


def classes_seen(train_labels, validation_labels, train_source: str, validation_source: str) -> None:
    """Every label of the validation rows is one the training rows have: a class only in validation cannot be
    learnt (and with --validation_file it is most often a file of another task or numbering)."""
    known = np.unique(np.asarray(train_labels))
    labels = np.asarray(validation_labels)
    unseen = ~np.isin(labels, known)
    if not unseen.any():
        return
    row = int(np.argmax(unseen))
    shown = ", ".join(str(c) for c in known[:10]) + (", ..." if len(known) > 10 else "")
    raise UsageError(f"{validation_source}: row {row + 1} has the label {labels[row]}, which no row of {train_source} "
                     f"has (its labels: {shown}; {int(unseen.sum())} such rows): a class only in validation cannot "
                     f"be learnt: give the files the same classes")


def finite_features(inputs: np.ndarray, features: list[str], source: str, first_line: int) -> None:
    """Refuse the first non-finite feature value (rows of `inputs` are the file's data rows in order; the first
    is on line `first_line`), unless --allow_nonfinite_data. `source`: named(flag, value)."""
    inputs = np.asarray(inputs)
    bad = ~np.isfinite(inputs)
    if not bad.any():
        return
    row, column = (int(i) for i in np.argwhere(bad)[0])
    value = inputs[row, column]
    what = "NaN or empty" if np.isnan(value) else f"{value}"
    raise UsageError(f"{source}: row {row + 1} (line {row + first_line}), column '{features[column]}' "
                     f"is {what}, not a finite number ({int(bad.any(axis=1).sum())} such rows): fix the file or pass "
                     f"--allow_nonfinite_data to train on them anyway")


def same_keys(rows: list[tuple[int, dict]], source: str) -> None:
    """Every JSON line has the keys of the first one. `source`: named(flag, value)."""
    if not rows:
        return
    first_number, first = rows[0]
    for number, row in rows[1:]:
        if row.keys() != first.keys():
            extra = sorted(row.keys() - first.keys()) or sorted(first.keys() - row.keys())
            raise UsageError(f"{source}: line {number} has the keys {', '.join(sorted(row))}, line "
                             f"{first_number} has {', '.join(sorted(first))} (column '{extra[0]}'): give every line "
                             f"the same keys")


def splittable(rows: int, val_fraction: float, shown: str) -> None:
    """`datasets`' train_test_split needs at least one row on each side."""
    test = int(np.ceil(rows * val_fraction))
    if test < 1 or rows - test < 1:
        raise UsageError(f"{shown} has {rows} row{'s' if rows != 1 else ''}: too few to split into training and "
                         f"validation at val_fraction={val_fraction:g}: give more rows")


def deepest_message(err: BaseException) -> str:
    """The message of the innermost cause (a pandas or pyarrow parse error behind `datasets`' generic one)."""
    seen = err
    while (seen.__cause__ or seen.__context__) is not None and seen is not (seen.__cause__ or seen.__context__):
        seen = seen.__cause__ or seen.__context__
    return (str(seen).strip().splitlines() or [type(seen).__name__])[-1][:200]


def utf8_lines(path: Path, source: str, flag: str):
    """(line number, text) of a UTF-8 file, line ends kept (LF, CRLF or CR), a leading BOM dropped; bytes that
    are not UTF-8 are one line naming `source` and the line, a file that cannot be read one line naming `flag`."""
    from ..errors import explain

    number = 0
    try:
        with open(path, "rb") as f:
            for chunk in f:
                for raw in chunk.splitlines(keepends=True):
                    number += 1
                    try:
                        text = raw.decode("utf-8")
                    except UnicodeDecodeError as err:
                        raise UsageError(f"{source}: line {number} is not UTF-8 text (byte 0x{raw[err.start]:02x}): "
                                         f"save the file as UTF-8") from None
                    yield number, text.removeprefix("\ufeff") if number == 1 else text
    except OSError as err:
        raise explain(err, flag, path) from None
