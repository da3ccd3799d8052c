"""A persistent memo of Inductor's CPU SIMD probe, so a warm-cache compile in a new process stays fast.

Inductor's C++ backend checks each SIMD ISA (AVX2, AVX-512, AMX, ...) once per process by building a
test library and loading it in a fresh Python interpreter: several seconds per ISA, every process.
The answer depends only on the machine, the compiler and torch, so we keep it in the cache folder.
"""

from __future__ import annotations

import contextlib
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

log = logging.getLogger("recir.lower_gpu")
_LOCK = threading.Lock()


def _machine_key() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    raw = "|".join((torch.__version__, platform.machine(), flags, os.environ.get("CXX", "")))
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _memoized(original: Any, path: Path) -> Any:
    def check_build(self: Any, code: str) -> bool:
        key = hashlib.sha256(f"{self._arch_flags}\n{code}".encode()).hexdigest()[:24]
        try:
            memo = json.loads(path.read_text())
        except (OSError, ValueError):
            memo = {}
        if key in memo:
            return bool(memo[key])
        ok = bool(original(self, code))
        memo[key] = ok
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(memo))
            os.replace(tmp, path)
        except OSError as exc:  # a read-only cache only costs the probe next time
            log.debug("recir.lower_gpu: could not save the CPU ISA probe memo: %s", exc)
        return ok

    check_build._recir_memo = True  # type: ignore[attr-defined]
    return check_build


@contextlib.contextmanager
def memoized_cpu_isa_probe(cache_dir: Path) -> Iterator[bool]:
    """``VecISA.check_build`` answered from an on-disk memo in ``cache_dir`` for the duration of a block
    (yields False if torch has no such hook; nests; restored on exit, so other torch.compile users in the
    process probe as they would without RecIR)."""
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        yield False
        return
    original = getattr(cpu_vec_isa.VecISA, "check_build", None)
    if original is None:
        yield False
        return
    if getattr(original, "_recir_memo", False):  # an enclosing block installed it
        yield True
        return
    with _LOCK:
        cpu_vec_isa.VecISA.check_build = _memoized(
            original, cache_dir / f"recir-cpu-isa-probe-{_machine_key()}.json"
        )
    try:
        yield True
    finally:
        with _LOCK:
            cpu_vec_isa.VecISA.check_build = original
