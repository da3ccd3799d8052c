"""Transparent huge pages for large host tables (Linux).

A lookup or row update touches rows spread over the whole table, so on the CPU every id of a table much
larger than the caches pays a TLB miss as well as a cache miss: 4 KiB pages give a second-level TLB a
reach of a few MiB. Backed by 2 MiB pages the same TLB covers gigabytes. Where the kernel's transparent
huge pages are in ``madvise`` mode (the common default) a process gets them only for ranges it advises,
so the lowerings advise the state buffers of their large tables: ``MADV_HUGEPAGE`` for the pages faulted
later, then ``MADV_COLLAPSE`` (Linux 6.1+) to rebuild the pages already written as huge pages, in place
(contents unchanged; about 0.25 s per 100 MiB on a 2-core Xeon). Measured there: gathering and
scatter-adding 2,600 random rows of a 5M x 32 fp32 table (610 MiB) 0.34 -> 0.24 ms.

Everything here is advice: where the kernel, the platform or the mode does not allow it, nothing changes
and the functions return 0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger("recir.embedding")

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
#: Buffers at least this large are advised by default (the lowerings' ``huge_pages_min_bytes``): the
#: collapse costs time per byte at setup, and a table of a few hundred MiB is where ids miss the TLB.
DEFAULT_MIN_BYTES = 256 << 20
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``), None where unknown."""
    try:
        with open(_THP_MODE) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def huge_pages_supported() -> bool:
    """Whether :func:`advise_huge_pages` can back already-written memory here: Linux 6.1+ (``MADV_COLLAPSE``)
    with transparent huge pages not switched off."""
    if _madvise() is None or thp_mode() in (None, "never"):
        return False
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 1)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def trim_host_heap() -> bool:
    """Hand the C heap's free pages back to the kernel (glibc's ``malloc_trim(0)``); False where there is
    no glibc. Freed memory stays resident otherwise: a JAX lowering's or a state copy's temporaries,
    freed between live allocations, kept a full-size DLRMv3 TPU-path process 0.6-0.75 GiB above what it
    held (measured on a 2-core EPYC: 2.37 -> 1.62 GiB once the state was built and the step traced)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    libc = _libc()
    if libc is None:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(address: int, nbytes: int, *, collapse: bool = True) -> int:
    """Back the whole 2 MiB pages inside ``[address, address + nbytes)`` by huge pages; returns the bytes
    advised (0 where nothing was: no Linux, THP ``never``, a range under one huge page, or the kernel
    refused). ``collapse``: also rebuild the pages already written (``MADV_COLLAPSE``; skipped, with the
    advice kept for later faults, on kernels before 6.1)."""
    madvise = _madvise()
    if madvise is None or thp_mode() in (None, "never"):
        return 0
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return 0
    if madvise(start, end - start, MADV_HUGEPAGE) != 0:
        log.debug("recir.embedding: madvise(MADV_HUGEPAGE) failed, errno %d", ctypes.get_errno())
        return 0
    if collapse and madvise(start, end - start, MADV_COLLAPSE) != 0:
        # EINVAL before Linux 6.1; EAGAIN/ENOMEM when no huge pages are free: the advice stands
        log.debug("recir.embedding: madvise(MADV_COLLAPSE) failed, errno %d", ctypes.get_errno())
    return end - start


def advise_large_buffers(
    buffers: Iterable[tuple[int, int]], min_bytes: int | None = DEFAULT_MIN_BYTES
) -> int:
    """:func:`advise_huge_pages` for every ``(address, nbytes)`` of at least ``min_bytes`` (None: none);
    returns the bytes advised in all, and logs them."""
    if min_bytes is None:
        return 0
    total = sum(advise_huge_pages(a, n) for a, n in buffers if n >= min_bytes)
    if total:
        log.info("recir.embedding: %.0f MiB of large state buffers backed by huge pages", total / 2**20)
    return total


def huge_page_bytes(address: int, nbytes: int) -> int:
    """How much of ``[address, address + nbytes)`` is backed by transparent huge pages now
    (``AnonHugePages`` of the mappings it overlaps in ``/proc/self/smaps``; 0 where unknown)."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    total, inside = 0, False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < address + nbytes and address < hi
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


@dataclass(frozen=True)
class HeapFree:
    """Free memory the C heap holds (glibc's ``malloc_info`` and ``mallinfo2``), in bytes: ``largest``, the
    largest free chunk in any arena's bins; ``top``, the main arena's top chunk (it can also grow);
    ``free``, all free bytes in the arenas, the top included (resident or not: a trim releases pages,
    the chunks stay)."""

    largest: int
    top: int
    free: int

    def fits(self, nbytes: int) -> bool:
        """Whether one allocation of ``nbytes`` is served without growing the heap. An aligned allocation
        (``posix_memalign``, what XLA's CPU runtime makes) takes a chunk of ``nbytes`` plus its alignment and
        a header, so the chunk a freed block of the same size leaves need not hold it (it does only where a
        neighbour's free bytes merged into it): measured, a 200 MiB block aligned to 64 bytes, freed and asked
        for again, came from the heap's top. Hence the slack."""
        return max(self.largest, self.top) >= nbytes + _ALIGNED_SLACK

    def growth(self, nbytes: int) -> int:
        """How far the heap grows for one allocation of ``nbytes`` that no free chunk in the bins holds:
        the part the top chunk does not cover (0 where :meth:`fits`)."""
        return 0 if self.fits(nbytes) else nbytes + _ALIGNED_SLACK - self.top


_ALIGNED_SLACK = 1 << 20  # alignments up to 1 MiB and glibc's chunk header
_CHUNK = re.compile(rb'<(?:size|unsorted) from="\d+" to="(\d+)"')


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]  # fmt: skip


@functools.cache
def _malloc_stats() -> ctypes.CDLL | None:
    """The C library with ``mallinfo2``, ``malloc_info`` and what reading it needs typed once; None without
    glibc 2.33+."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2") or not hasattr(libc, "malloc_info"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    libc.open_memstream.restype = ctypes.c_void_p
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    return libc


def host_heap_free() -> HeapFree | None:
    """The C heap's free chunks now (:class:`HeapFree`); None where there is no glibc 2.33+ (``mallinfo2``).
    Costs a walk of the arenas' free lists (well under a millisecond for a training process's heap)."""
    libc = _malloc_stats()
    if libc is None:
        return None
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        return None
    try:
        libc.malloc_info(0, stream)
    finally:
        libc.fclose(stream)  # flushes: buf and size are set now
    try:
        text = ctypes.string_at(buf, size.value) if buf.value else b""
    finally:
        libc.free(buf)
    info = libc.mallinfo2()
    largest = max((int(m.group(1)) for m in _CHUNK.finditer(text)), default=0)
    return HeapFree(largest=largest, top=int(info.keepcost), free=int(info.fordblks))


def make_heap_room(nbytes: int, *, min_free: int = 64 << 20) -> bool:
    """Before allocating one block of ``nbytes``: when no free chunk of the C heap holds it, so the heap
    grows by at least ``min_free`` beyond its top, while at least ``min_free`` bytes lie free in chunks too
    small for it, hand those chunks' pages back to the kernel first (:func:`trim_host_heap`), so the new
    block does not sit beside that much resident free memory. Returns whether it trimmed.

    This is for processes that keep freed memory (``recir.lower_gpu.retain_host_memory``: no trim, no
    mmap): there, a large block freed below a small allocation that stays live (or split by small ones) is
    not taken again by the next block of its size (see :meth:`HeapFree.fits`), and without this the peak
    resident memory grows by the block's size once more.

    - A block the heap's top nearly holds (the usual case when one block size repeats: each call's block
      goes back to the top) grows the heap by the difference only, so nothing is trimmed then: trimming
      would hand back pages the next call faults in again (measured on a full-size DLRMv3 step: 400 ->
      507 ms).
    - After a trim, the largest free chunk (the one too small for this block), when it is at least
      ``min_free``, is held out of play for the process's life: allocated, never written, so its pages stay
      with the kernel. Left free, a smaller block (several block sizes: one per token budget) would take it
      and fault its pages in again while the top, where the larger blocks go, stays resident too: full-size
      DLRMv3 at UIH 64 with four budgets grew 2.16 -> 2.36 GiB that way, after such a trim. Held, every
      block comes from the top. This costs address space, not memory, and happens about once a process."""
    heap = host_heap_free()
    if heap is None or heap.fits(nbytes) or heap.growth(nbytes) < min_free or heap.free - heap.top < min_free:
        return False
    log.debug(
        "recir.embedding: a %.0f MiB block does not fit the heap's free chunks (largest %.0f MiB, top %.0f MiB, "
        "%.0f MiB free): trimming first", nbytes / 2**20, heap.largest / 2**20, heap.top / 2**20, heap.free / 2**20,
    )  # fmt: skip
    if not trim_host_heap():
        return False
    if heap.largest >= min_free:
        _hold_free_chunk(heap.largest)
    return True


#: Free chunks :func:`make_heap_room` holds out of play (their addresses), for the process's life.
_HELD_CHUNKS: list[int] = []


def _hold_free_chunk(nbytes: int) -> None:
    """Allocate the heap's largest free chunk, of ``nbytes``, and keep it without writing it (its pages,
    handed back by a trim, stay with the kernel). The allocation asks a little less than the chunk, so malloc's
    best fit takes that chunk; should it come from elsewhere (the chunk was taken meanwhile) it is freed."""
    libc = _malloc_stats()
    if libc is None:
        return
    ptr = libc.malloc(nbytes - _HOLD_MARGIN)
    if not ptr:
        return
    after = host_heap_free()
    if after is None or after.largest >= nbytes:  # not that chunk: give it back
        libc.free(ptr)
        return
    _HELD_CHUNKS.append(ptr)
    log.debug("recir.embedding: holding a %.0f MiB free chunk out of play", nbytes / 2**20)


_HOLD_MARGIN = 4 << 10  # under the chunk's size by its header and more: best fit still picks that chunk
