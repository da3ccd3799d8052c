"""JAX's persistent compilation cache under ``$RECIR_CACHE_DIR/jax`` (default ``~/.cache/recir/jax``).

JAX keys each entry on the fingerprint of the lowered program (its HLO) plus compile options, the
backend and the jax/jaxlib versions, so a changed graph compiles afresh and never reuses a stale artifact.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import jax

logger = logging.getLogger("recir.lower_tpu")
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_counts = {"hits": 0}


def _on_event(event: str, **kwargs: object) -> None:
    if event == _HIT_EVENT:
        _counts["hits"] += 1


jax.monitoring.register_event_listener(_on_event)


def cache_hits() -> int:
    """How many programs this process loaded from the persistent cache so far (JAX's monitoring event)."""
    return _counts["hits"]


def default_cache_dir() -> Path:
    """``$RECIR_CACHE_DIR/jax``, or ``~/.cache/recir/jax``."""
    root = os.environ.get("RECIR_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "recir")
    return Path(root) / "jax"


_CACHE_OPTIONS = (
    "jax_enable_compilation_cache",
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
)


@contextlib.contextmanager
def compile_cache(path: str | os.PathLike[str] | None = None, *, enabled: bool = True) -> Iterator[None]:
    """JAX's persistent cache as :func:`enable_compile_cache` sets it (or off, ``enabled=False``), for the
    duration of a block: RecIR's own compiles. On exit the four cache options get their values back and
    JAX's cache module is reset (``reset_cache``; it memoises whether a cache is in use at the first
    compile), so the user's own ``jax.jit`` compiles in the process behave exactly as without RecIR."""
    saved = {name: read_option(name) for name in _CACHE_OPTIONS}
    _reset_jax_cache()  # a user's earlier compile may have memoised "no cache"
    try:
        if enabled:
            enable_compile_cache(path)
        else:
            jax.config.update("jax_enable_compilation_cache", False)
        yield
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        _reset_jax_cache()


def read_option(name: str) -> object:
    """A JAX config option's current value (``jax.config.read`` refuses options that have a context manager)."""
    return getattr(jax.config, name)


def _reset_jax_cache() -> None:
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()


def enable_compile_cache(path: str | os.PathLike[str] | None = None) -> Path:
    """Point JAX's persistent cache at ``path`` (default: :func:`default_cache_dir`) and cache every program,
    for the rest of the process (an explicit opt-in; ``compile`` itself only sets it while it compiles).

    The thresholds drop to zero so that small programs (tests, tiny models) are cached too. A directory
    the user already configured (``jax_compilation_cache_dir``) is kept. JAX reads the directory when it
    first compiles with a cache, so the first setting in a process wins.
    """
    current = jax.config.values.get("jax_compilation_cache_dir") if hasattr(jax.config, "values") else None
    if current is None:
        current = getattr(jax.config, "jax_compilation_cache_dir", None)
    target = Path(path) if path is not None else default_cache_dir()
    if current and Path(current) != target:
        logger.debug("recir.lower_tpu: keeping the JAX compilation cache at %s", current)
        target = Path(current)
    target.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(target))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return target
