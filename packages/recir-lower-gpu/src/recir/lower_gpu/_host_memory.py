"""Keep freed host memory in the process between training steps (glibc malloc), an explicit opt-in.

A compiled step on the CPU device allocates its activations afresh every step (Inductor's wrapper
frees each buffer after its last use). With glibc's defaults, freed memory at the top of the heap is
returned to the operating system (trimmed) and blocks above the dynamic mmap threshold are unmapped,
so the next step touches new pages again: full-size DLRMv3 took about 55K minor page faults per step
(about 210 MiB zeroed by the kernel), 0.09 s of system time per step, and the step ran about 14%
slower than with the memory kept (bf16, UIH 64, batch 16, 2 threads: 268 against 230 ms/step).

`retain_host_memory()` sets malloc parameters for the whole process, which is why it is a function
the application calls (`recir-dlrmv3` does, unless `--host_memory release`) and not a default of
`compile`: never trim the heap's top, pad heap growth, serve blocks up to `mmap_threshold_mib`
(glibc's ceiling: 32 MiB) from the heap, and with ``heap_only`` larger blocks too, from one arena.
Freed memory then keeps its pages. The price is resident memory: the process keeps its peak heap after
a step instead of returning it. glibc has no way to read the parameters back, so this cannot be undone.

The TPU path on a CPU needs ``heap_only``: XLA's CPU runtime allocates large buffers from its own
threads, which glibc serves with fresh mappings (77K page faults per full-size step); heap-only,
full-size bf16 UIH 64 ran at 406 and 398 against 476 and 471 ms/step (the GPU path: the same either way).
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

_log = logging.getLogger("recir.lower_gpu")

# mallopt parameter numbers from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_GLIBC_MMAP_CEILING_MIB = 32  # glibc refuses larger thresholds (HEAP_MAX_SIZE / 2 on 64-bit)


def retain_host_memory(
    *, top_pad_mib: int = 64, mmap_threshold_mib: int = _GLIBC_MMAP_CEILING_MIB, heap_only: bool = True
) -> bool:
    """Make this process keep freed host memory for reuse instead of returning it to the OS.

    ``heap_only`` (default): also serve blocks above the mmap threshold from one heap (no mmap, one
    malloc arena for all threads), so they keep their pages too; what XLA's CPU runtime needs (its
    buffers are large and allocated from its own threads). Call it before other threads allocate.

    Returns True when applied, False (with a debug log line saying why) where the C library is not
    glibc (musl, macOS, Windows), where nothing changes. Raises ValueError for out-of-range sizes.
    """
    if not 0 <= top_pad_mib <= 1024:
        raise ValueError(
            f"top_pad_mib={top_pad_mib} is outside [0, 1024]: pass the heap growth padding in MiB"
        )
    if not 0 < mmap_threshold_mib <= _GLIBC_MMAP_CEILING_MIB:
        raise ValueError(
            f"mmap_threshold_mib={mmap_threshold_mib} is outside (0, {_GLIBC_MMAP_CEILING_MIB}]: glibc rejects "
            f"larger thresholds; pass at most {_GLIBC_MMAP_CEILING_MIB}"
        )
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        _log.debug("retain_host_memory: not glibc (%s %s), left as it is", sys.platform, platform.libc_ver())
        return False
    libc = ctypes.CDLL(None)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        _log.debug("retain_host_memory: this C library has no mallopt, left as it is")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    applied = (
        (not heap_only or (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_ARENA_MAX, 1)))
        and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
        and mallopt(_M_TOP_PAD, top_pad_mib << 20)
        and mallopt(_M_MMAP_THRESHOLD, mmap_threshold_mib << 20)
    )
    if not applied:
        _log.debug("retain_host_memory: glibc refused a mallopt setting")
        return False
    _log.debug("host memory: freed memory is kept in the process (malloc trim off, mmap threshold %d MiB)",
               mmap_threshold_mib)  # fmt: skip
    return True
