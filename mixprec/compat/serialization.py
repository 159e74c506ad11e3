"""How the serializers report a disk that refuses a write (safetensors 0.7, torch 2.13; canary: the disk tests in
tests/test_run_folder.py, on a real full and a real read-only filesystem).

Neither raises OSError: safetensors raises `SafetensorError("Error while serializing: I/O error: No space left on
device (os error 28)")`, and torch.save raises `RuntimeError("PytorchStreamWriter failed writing file ...: file
write failed")` or, when the disk fills while its zip writer writes the header, `RuntimeError("[enforce fail at
inline_container.cc:672] . unexpected pos 704 vs 598")` (canary: tests/test_compat.py, a real full tmpfs).
`storage_failure` recognizes them (and OSError) so that the recipe can turn them into one line.
"""
from __future__ import annotations

import os
import re


def storage_failure(err: BaseException) -> str | None:
    """What went wrong, when `err` is a write refused by the disk; None for any other error."""
    if isinstance(err, OSError):
        return f"{err.strerror or err} (errno {err.errno})" if err.errno else str(err)
    text = str(err)
    found = re.search(r"os error (\d+)", text)  # safetensors (Rust's io::Error)
    if found:
        code = int(found.group(1))
        return f"{os.strerror(code)} (errno {code})"
    if "unexpected pos" in text and "inline_container" in text:  # torch.save: a short write (a full disk)
        return "a short write, the disk is full or refused it (torch: " + text.strip().splitlines()[0][:120] + ")"
    if "file write failed" in text or "PytorchStreamWriter failed" in text:  # torch.save
        return "the write failed (" + text.strip().splitlines()[0][:160] + ")"
    return None


def umask_modes(root) -> None:
    """safetensors 0.8 writes each file through a temporary file that its `tempfile` crate creates with mode 0600
    and renames into place (github.com/safetensors/safetensors/issues/782; the fix, pull/789, is open):
    model.safetensors is readable by its owner only while every other file of a run follows the umask, and
    another user of a shared machine or a container cannot load the model. Each `*.safetensors` under `root` (a
    file or a folder) that has mode 0600 gets the mode a new file gets, 0o666 without the umask's bits (canary:
    tests/test_compat.py)."""
    from pathlib import Path

    mask = os.umask(0o022)  # reading the umask sets it: set it back at once
    os.umask(mask)
    root = Path(root)
    for path in ([root] if root.is_file() else root.rglob("*.safetensors")):
        if path.suffix == ".safetensors" and path.is_file() and path.stat().st_mode & 0o777 == 0o600:
            os.chmod(path, 0o666 & ~mask)
