"""The persistent compile cache: where Inductor's FX graph cache and AOTAutograd cache live.

Inductor keys both caches by the graph (code, shapes, strides, dtypes, devices, config and torch
version), so a changed StepGraph never reuses a stale artifact; we only choose the folder.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def _torch_default_inductor_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # a torch without it: every setting counts as the user's
        return None
    return default_cache_dir()


def _user_inductor_dir(raw: str | None) -> str | None:
    """``TORCHINDUCTOR_CACHE_DIR`` when a user chose it. Torch writes its own default
    (``/tmp/torchinductor_<user>``) into the variable the first time anything asks for the folder, and
    importing torchrec does, so a value equal to that default is torch's, not a choice: RecIR's folder
    (which survives reboots) is used instead."""
    return None if not raw or raw == _torch_default_inductor_dir() else raw


# Read once at import (before a RecIR compile sets the variable for its own block).
_USER_INDUCTOR_DIR = _user_inductor_dir(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))


def recir_cache_dir() -> Path:
    """``$RECIR_CACHE_DIR``, default ``~/.cache/recir``."""
    raw = os.environ.get("RECIR_CACHE_DIR")
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "recir"


def inductor_cache_dir(explicit: str | None = None) -> Path:
    """The Inductor cache folder: explicit > the user's TORCHINDUCTOR_CACHE_DIR > $RECIR_CACHE_DIR/inductor."""
    if explicit is not None:
        return Path(explicit).expanduser()
    if _USER_INDUCTOR_DIR:
        return Path(_USER_INDUCTOR_DIR).expanduser()
    return recir_cache_dir() / "inductor"


@contextlib.contextmanager
def using_cache_dir(path: Path) -> Iterator[None]:
    """Point Inductor (and Triton, which derives its folder from it) at ``path`` for a block."""
    path.mkdir(parents=True, exist_ok=True)
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def _reduce_memory_format(fmt: torch.memory_format) -> tuple[Any, tuple[str]]:
    from torch._inductor.codecache import _ident

    return (_ident, (str(fmt),))


@contextlib.contextmanager
def stable_cache_keys() -> Iterator[bool]:
    """Inductor's cache keys independent of import order, for the duration of a block (yields False when
    this torch has no such pickler; nests; undone on exit, so other torch.compile users never see it).

    ``torch.memory_format`` pickles as a global named ``torch.contiguous_format``, which pickle resolves
    by scanning ``sys.modules`` for the first module with a ``torch`` attribute: the key's bytes then
    depend on which modules a process imported first (a pytest run and a script disagree), so a
    second process misses the cache. Inside the block the key-only picklers get a reducer that writes
    the name.
    """
    try:
        from torch._inductor.codecache import FxGraphCachePickler
    except ImportError:
        yield False
        return
    init = FxGraphCachePickler.__init__
    if getattr(init, "_recir_stable", False):  # an enclosing block installed it
        yield True
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.dispatch_table[torch.memory_format] = _reduce_memory_format

    __init__._recir_stable = True  # type: ignore[attr-defined]
    FxGraphCachePickler.__init__ = __init__  # type: ignore[method-assign]
    try:
        yield True
    finally:
        FxGraphCachePickler.__init__ = init  # type: ignore[method-assign]
