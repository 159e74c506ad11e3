"""Errors the user can act on: one line naming the value and the fix, a documented exit code, no traceback.

Exit codes of the recipes:
    0   done
    2   bad input (UsageError): nothing in the run folder was created, changed or removed
    3   halted on a NaN/Inf step (--on_nan halt); the last good checkpoint is kept (mixprec.health)
    74  the disk refused a write while saving a checkpoint (StorageError); the previous one stays latest
    75  stopped by a signal after saving a checkpoint: run again with --resume_from_checkpoint latest
        (mixprec.run_folder.preemption)
`accelerate launch` turns every non-zero exit code of its processes into 1 (the one line stays above its own
report); `python recipes/train.py` keeps them.
"""
from __future__ import annotations

import errno
import functools
import os
import sys
import time

USAGE_EXIT_CODE = 2
STORAGE_EXIT_CODE = 74
# Every process meets the same bad input, and the main process says it. A launcher stops all processes when the
# first one exits: the others wait this long before exiting, so that the first to exit is the main process
# (then the launcher stops them); one still running after the wait met an error of its own and says it.
OTHER_RANKS_WAIT_S = 10.0


class UsageError(Exception):
    """Input the user can fix. The message names the bad value and the fix."""

    exit_code = USAGE_EXIT_CODE


# errnos of a disk that refuses a write: anywhere in the run (config.yaml, metrics.jsonl, summary.json, metrics.png,
# the export, a checkpoint) they end the run in one line with exit code 74; the newest checkpoint stays the latest
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG}


class StorageError(Exception):
    """The disk refused a write (full, read-only, no permission). The message names the path and the fix."""

    exit_code = STORAGE_EXIT_CODE


def _is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def exit_on_usage_error(main):
    """Turn a UsageError or StorageError raised anywhere in `main` into one line on stderr and its exit code."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (UsageError, StorageError) as err:
            if _is_main_rank():
                print(f"error: {one_line(str(err))}", file=sys.stderr, flush=True)
            else:  # see OTHER_RANKS_WAIT_S
                time.sleep(OTHER_RANKS_WAIT_S)
                print(f"error: (process {os.environ.get('RANK')}) {one_line(str(err))}", file=sys.stderr, flush=True)
            sys.exit(err.exit_code)
        except Exception as err:
            storage = refused_write(err)
            if storage is None:
                raise
            if _is_main_rank():
                print(f"error: {one_line(storage)}", file=sys.stderr, flush=True)
            sys.exit(STORAGE_EXIT_CODE)

    return wrapper


def one_line(text: str) -> str:
    """The message as one line: characters that break or control a line (a newline in a path, a separator, an
    escape) are shown escaped, as Python writes them."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def name_the_file(err: BaseException, path) -> None:
    """A refused write() raises OSError without a file name: give it `path`, for `refused_write`'s line."""
    if isinstance(err, OSError) and err.filename is None:
        err.filename = str(path)


def refused_write(err: Exception) -> str | None:
    """One line for a write the disk refused outside a checkpoint (those are StorageErrors already), else None."""
    from .compat.serialization import storage_failure

    if isinstance(err, OSError) and err.errno not in STORAGE_ERRNOS:
        return None
    failure = storage_failure(err)
    if failure is None:
        return None
    where = f" {err.filename}" if getattr(err, "filename", None) else ""
    return (f"the disk refused a write{where}: {failure}: free space or make the run folder writable, then continue "
            f"with --resume_from_checkpoint latest (the newest checkpoint stays the latest)")


ADVICE = {errno.ENOSPC: "the disk is full: free space", errno.EDQUOT: "the disk quota is used up: free space",
          errno.EROFS: "the file system is read-only: make the run folder writable",
          errno.EACCES: "no permission: make the run folder writable", errno.EPERM: "no permission: make the run "
          "folder writable", errno.ENOTDIR: "a file is where a folder should be: move it away",
          errno.EISDIR: "a folder is where a file should be: move it away", errno.EEXIST: "something is in the "
          "way: move it away", errno.ENOENT: "a folder was removed during the run: do not delete the run folder",
          errno.ECONNREFUSED: "the server refused the connection: check the address and the network",
          errno.ETIMEDOUT: "the network timed out: check the connection"}


def advice(err: BaseException) -> str | None:
    """What the user should do about an OSError, from its errno (None when there is nothing to say)."""
    return ADVICE.get(getattr(err, "errno", None)) if isinstance(err, OSError) else None


ERRNO_ADVICE = {
    errno.ENOENT: "it does not exist: check the path",
    errno.EACCES: "permission denied: fix its permissions or choose another path",
    errno.EPERM: "the operation is not permitted: fix its permissions or choose another path",
    errno.EEXIST: "a file or a link is in the way (a symbolic link that points to itself?): remove it or choose "
                  "another path",
    errno.ELOOP: "it is a loop of symbolic links: point the link at a real file or folder",
    errno.ENOTDIR: "a part of the path is a file, not a folder: fix the path",
    errno.EISDIR: "it is a folder where a file is expected: give a file",
    errno.ENAMETOOLONG: "a name in it is too long for the file system: choose a shorter name",
    errno.EROFS: "the file system is read-only: choose a writable folder",
    errno.ENOSPC: "the disk is full: free space or choose another disk",
    errno.EDQUOT: "your disk quota is used up: free space or choose another disk",
    errno.EIO: "the disk reported an input/output error: check the disk or choose another path",
}


def explain(err: OSError, flag: str, path) -> UsageError:
    """An OSError about `path` (given as `flag`) as one line that says what to do, not the errno text."""
    advice = ERRNO_ADVICE.get(err.errno, f"{err.strerror or err}: check the path")
    return UsageError(f"{flag} '{path}': {advice}")
