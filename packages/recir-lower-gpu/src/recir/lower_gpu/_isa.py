"""A persistent memo of Inductor's CPU SIMD probe, so a warm-cache compile in a new process stays fast.

Inductor's C++ backend checks each SIMD ISA (AVX2, AVX-512, AMX, ...) once per process by building a
test library and loading it in a fresh Python interpreter: several seconds per ISA, every process.
The answer depends only on the machine, the compiler and torch, so we keep it in the cache folder.

The first compile on a machine (no memo yet) still pays the probe: about 30 s for the ten checks on a
2-core Xeon, a third of a cold full-size DLRMv3 compile. :func:`probe_in_background` starts it in a
thread when a compile begins, so it runs while Inductor's Python passes (AOTAutograd, lowering,
scheduling) occupy the main thread, instead of after them; code generation, the first reader, waits
only for what is left.

The two threads must not build torch's ISA list at the same time: torch's AVX-512 check appends
``-mavx512bf16`` to the shared ISA object's flags for its probe and puts back what it read, so two
interleaved checks leave the flag in the flags for good, and every kernel's compile command (part of
its cache key) then differs from the next process's: the machine's second compile missed the C++ cache
and compiled every kernel again (35-53 s on a 2-core EPYC). While a block is open, building the list
takes a lock; the second caller gets the first one's list.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ._files import write_atomic

log = logging.getLogger("recir.lower_gpu")
_LOCK = threading.Lock()  # installs and removes the hook
_MEMO_LOCK = threading.Lock()  # the memo file's read-modify-write, and the in-flight table
_IN_FLIGHT: dict[str, threading.Event] = {}  # probes running in some thread, by key
_DEPTH = 0  # open memoized_cpu_isa_probe blocks (the hook stays until the last one closes)
_replaced: Any = None  # the check_build the outermost open block replaced (restored when the last closes)
_replaced_list: Any = None  # the valid_vec_isa_list it replaced
_LIST_LOCK = threading.RLock()  # one thread at a time builds torch's ISA list (see the module docstring)
_COMPLETE = "__complete__"  # memo key: every ISA this machine lists has been probed


def _machine_key() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    raw = "|".join((torch.__version__, platform.machine(), flags, os.environ.get("CXX", "")))
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def memo_path(cache_dir: Path) -> Path:
    """The memo file for this machine, compiler and torch in ``cache_dir``."""
    return cache_dir / f"recir-cpu-isa-probe-{_machine_key()}.json"


def _read(path: Path) -> dict[str, bool]:
    try:
        memo = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _write(path: Path, key: str, ok: bool) -> None:
    with _MEMO_LOCK:  # two threads probing at once must not drop each other's answers
        memo = _read(path)
        memo[key] = ok
        try:
            write_atomic(path, json.dumps(memo).encode())
        except OSError as exc:  # a read-only cache only costs the probe next time
            log.debug("recir.lower_gpu: could not save the CPU ISA probe memo: %s", exc)


def _memoized(original: Any, path: Path) -> Any:
    def check_build(self: Any, code: str) -> bool:
        key = hashlib.sha256(f"{self._arch_flags}\n{code}".encode()).hexdigest()[:24]
        while True:  # answered by the memo, or by the thread already probing this ISA, or probed here
            if key in (memo := _read(path)):
                return bool(memo[key])
            with _MEMO_LOCK:
                running = _IN_FLIGHT.get(key)
                if running is None:
                    _IN_FLIGHT[key] = threading.Event()
                    break
            running.wait()  # then read its answer (if it could not save one, probe here)
        try:
            ok = bool(original(self, code))
            _write(path, key, ok)
            return ok
        finally:
            with _MEMO_LOCK:
                _IN_FLIGHT.pop(key).set()

    check_build._recir_memo = True  # type: ignore[attr-defined]
    return check_build


def _serialized(original: Any) -> Any:
    @functools.wraps(original)
    def valid_vec_isa_list() -> Any:
        with _LIST_LOCK:
            return original()

    valid_vec_isa_list._recir_original = original  # type: ignore[attr-defined]
    return valid_vec_isa_list


def _unserialized(fn: Any) -> Any:
    """torch's own ``valid_vec_isa_list`` (with its ``cache_info``), under our lock or not."""
    return getattr(fn, "_recir_original", fn)


@contextlib.contextmanager
def memoized_cpu_isa_probe(cache_dir: Path) -> Iterator[bool]:
    """``VecISA.check_build`` answered from an on-disk memo in ``cache_dir``, and torch's ISA list built by
    one thread at a time, for the duration of a block (yields False if torch has no such hook; nests, also
    across threads: the hooks stay until the last open block closes, then the originals are restored, so
    other torch.compile users in the process probe as they would without RecIR)."""
    global _DEPTH, _replaced, _replaced_list
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        yield False
        return
    with _LOCK:
        original = getattr(cpu_vec_isa.VecISA, "check_build", None)
        if original is not None:
            if _DEPTH == 0 and not getattr(original, "_recir_memo", False):
                cpu_vec_isa.VecISA.check_build = _memoized(original, memo_path(cache_dir))
                _replaced = original
                listing = getattr(cpu_vec_isa, "valid_vec_isa_list", None)
                if listing is not None and not hasattr(listing, "_recir_original"):
                    cpu_vec_isa.valid_vec_isa_list = _serialized(listing)
                    _replaced_list = listing
            _DEPTH += 1
    if original is None:
        yield False
        return
    try:
        yield True
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0 and _replaced is not None:
                cpu_vec_isa.VecISA.check_build, _replaced = _replaced, None
                if _replaced_list is not None:
                    cpu_vec_isa.valid_vec_isa_list, _replaced_list = _replaced_list, None


@contextlib.contextmanager
def probe_in_background(cache_dir: Path) -> Iterator[threading.Thread | None]:
    """Run Inductor's SIMD probe (every ISA this CPU lists) in a thread for the duration of a block, with
    the memo; joined when the block ends. Nothing starts when the memo already has the full answer (the
    common case: every compile after a machine's first). Yields the thread, or None."""
    if _read(memo_path(cache_dir)).get(_COMPLETE):
        yield None
        return
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        yield None
        return

    def probe() -> None:
        try:
            # torch caches the list per process: computed earlier without the memo, it probes nothing now
            info = getattr(_unserialized(cpu_vec_isa.valid_vec_isa_list), "cache_info", None)
            fresh = info is None or info().currsize == 0
            with memoized_cpu_isa_probe(cache_dir) as memoized:
                cpu_vec_isa.valid_vec_isa_list()
                if memoized and fresh:
                    _write(memo_path(cache_dir), _COMPLETE, True)
        except Exception as exc:  # noqa: BLE001 - the compile's own probe reports what matters
            log.debug("recir.lower_gpu: the background CPU ISA probe failed: %s", exc)

    thread = threading.Thread(target=probe, name="recir-cpu-isa-probe", daemon=True)
    with memoized_cpu_isa_probe(cache_dir):  # the hook spans the thread's life, not just the caller's
        thread.start()
        try:
            yield thread
        finally:
            thread.join()
