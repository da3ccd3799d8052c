"""Writing a cache file so that a reader, or a process killed mid-write, never sees half of it."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: into a temporary file beside it (``.tmp-*``, created with
    ``tempfile.mkstemp``, so mode 0600), flushed and fsynced, then moved over ``path`` with ``os.replace``.
    A reader sees the old file or the whole new one. Creates the parent folder if needed. On any failure
    (an interrupt included) the temporary file is removed and the error re-raised; ``path`` is untouched."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
