"""Writing a cache file so that a reader, or a process killed mid-write, never sees half of it."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: into a temporary file beside it (``.tmp-*``, from
    ``tempfile.mkstemp``), flushed and fsynced, then moved over ``path`` with ``os.replace``. A reader sees the
    old file or the whole new one. The file gets the mode a plain ``open(path, "wb")`` would give it (0666 less
    the umask), not mkstemp's 0600, so a cache folder shared between users stays readable to them. Creates the
    parent folder if needed. On any failure (an interrupt included) the temporary file is removed and the error
    re-raised; ``path`` is untouched."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """This process's umask, read without changing it where Linux reports it (``/proc/self/status``);
    elsewhere by setting it and restoring it at once."""
    with contextlib.suppress(OSError, StopIteration, ValueError), open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
