"""Bad input: one line naming the value and the fix, exit code 2, no traceback."""
from __future__ import annotations

import functools
import os
import sys


class UsageError(Exception):
    """Raised for input the user can fix. The message names the bad value and the fix."""


def _is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def exit_on_usage_error(main):
    """Turn a UsageError raised anywhere in `main` into one line on stderr and exit code 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UsageError as err:
            if _is_main_rank():  # every rank sees the same bad input; say it once
                print(f"error: {err}", file=sys.stderr, flush=True)
            sys.exit(2)

    return wrapper
