"""A persistent memo of Inductor's CPU SIMD probe, so a warm-cache compile in a new process stays fast.

Inductor's C++ backend checks each SIMD ISA (AVX2, AVX-512, AMX, ...) once per process by building a
test library and loading it in a fresh Python interpreter: several seconds per ISA, every process.
The answer depends only on the machine, the compiler and torch, so we keep it in the cache folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("recir.lower_gpu")
_LOCK = threading.Lock()
_INSTALLED: dict[str, Any] = {}


def _machine_key() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    raw = "|".join((torch.__version__, platform.machine(), flags, os.environ.get("CXX", "")))
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def memoize_cpu_isa_probe(cache_dir: Path) -> bool:
    """Wrap ``VecISA.check_build`` with an on-disk memo in ``cache_dir``; False if torch has no such hook."""
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return False
    original = getattr(cpu_vec_isa.VecISA, "check_build", None)
    if original is None:
        return False
    with _LOCK:
        _INSTALLED["path"] = cache_dir / f"recir-cpu-isa-probe-{_machine_key()}.json"
        if "original" in _INSTALLED:
            return True
        _INSTALLED["original"] = original

        def check_build(self: Any, code: str) -> bool:
            path: Path = _INSTALLED["path"]
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

        cpu_vec_isa.VecISA.check_build = check_build
    return True
