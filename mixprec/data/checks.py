"""Checks of local data files before a run uses them: values that are not finite numbers (NaN, inf, empty
fields), JSON lines whose keys differ, and too few rows to split. Each is one line naming the file, the row and
the column, and the fix."""
from __future__ import annotations

import numpy as np

from ..errors import UsageError


def finite_features(inputs: np.ndarray, features: list[str], shown: str, first_line: int) -> None:
    """Refuse the first non-finite feature value (rows of `inputs` are the file's data rows in order; the first
    is on line `first_line`), unless --allow_nonfinite_data."""
    inputs = np.asarray(inputs)
    bad = ~np.isfinite(inputs)
    if not bad.any():
        return
    row, column = (int(i) for i in np.argwhere(bad)[0])
    value = inputs[row, column]
    what = "NaN or empty" if np.isnan(value) else f"{value}"
    raise UsageError(f"--train_file '{shown}': row {row + 1} (line {row + first_line}), column '{features[column]}' "
                     f"is {what}, not a finite number ({int(bad.any(axis=1).sum())} such rows): fix the file or pass "
                     f"--allow_nonfinite_data to train on them anyway")


def same_keys(rows: list[tuple[int, dict]], shown: str) -> None:
    """Every JSON line has the keys of the first one."""
    if not rows:
        return
    first_number, first = rows[0]
    for number, row in rows[1:]:
        if row.keys() != first.keys():
            extra = sorted(row.keys() - first.keys()) or sorted(first.keys() - row.keys())
            raise UsageError(f"--train_file '{shown}': line {number} has the keys {', '.join(sorted(row))}, line "
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
