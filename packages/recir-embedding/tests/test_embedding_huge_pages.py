"""recir.embedding.advise_huge_pages: large host buffers backed by transparent huge pages, values kept."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
import torch
from recir.embedding import (
    advise_huge_pages,
    advise_large_buffers,
    host_heap_free,
    huge_page_bytes,
    huge_pages_supported,
)

needs_thp = pytest.mark.skipif(
    not huge_pages_supported(), reason="needs Linux 6.1+ with transparent huge pages"
)


@needs_thp
def test_advise_backs_a_written_buffer_by_huge_pages_and_keeps_its_values():
    t = torch.randn(4 << 20)  # 16 MiB, written before the advice: MADV_COLLAPSE rebuilds it in place
    before = t.clone()
    advised = advise_huge_pages(t.data_ptr(), t.nbytes)
    assert advised >= 12 << 20  # the whole 2 MiB pages inside the buffer
    assert huge_page_bytes(t.data_ptr(), t.nbytes) >= 2 << 20
    assert torch.equal(t, before)


def test_small_buffers_and_thresholds_advise_nothing():
    t = torch.randn(1000)
    assert advise_huge_pages(t.data_ptr(), t.nbytes) == 0  # under one huge page
    big = torch.randn(4 << 20)
    assert advise_large_buffers([(big.data_ptr(), big.nbytes)], min_bytes=None) == 0
    assert advise_large_buffers([(big.data_ptr(), big.nbytes)], min_bytes=big.nbytes + 1) == 0


_HEAP_ROOM_CHILD = r"""
import ctypes, json
from recir.embedding import host_heap_free, make_heap_room

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
# what recir.lower_gpu.retain_host_memory sets: no mmap (one heap), no trim of the heap's top
assert libc.mallopt(-4, 0) and libc.mallopt(-8, 1) and libc.mallopt(-1, 2**31 - 1)

def rss():
    return next(int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith("VmRSS:"))

def aligned(n):  # how XLA's CPU runtime allocates its buffers
    p = ctypes.c_void_p()
    assert libc.posix_memalign(ctypes.byref(p), 64, n) == 0
    return p.value

MiB = 1 << 20
big = aligned(200 * MiB)
ctypes.memset(big, 1, 200 * MiB)  # resident
# live, above it (larger than any free chunk, so it comes from the top): the freed block cannot merge back
guard = host_heap_free().largest + (64 << 10)
small = libc.malloc(guard)
ctypes.memset(small, 1, guard)
libc.free(big)
heap = host_heap_free()
out = {"largest": heap.largest, "fits_150": heap.fits(150 * MiB), "fits_200": heap.fits(200 * MiB)}
before = rss()
out["room_150"] = make_heap_room(150 * MiB)  # the freed block holds it: nothing to do
out["kept"] = before - rss()
out["room_200"] = make_heap_room(200 * MiB)  # it does not: its pages go back first
out["released"] = before - rss()
out["largest_after"] = host_heap_free().largest  # the freed block's chunk is held out of play now
out["room_200_small_free"] = make_heap_room(200 * MiB, min_free=2**40)  # too little free to bother
# a smaller block does not take the held chunk (and fault its pages in again): it comes from elsewhere
smaller = aligned(150 * MiB)
out["smaller_in_old_chunk"] = big <= smaller < big + 200 * MiB
print(json.dumps(out))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc" or host_heap_free() is None,
    reason="glibc 2.33+'s malloc (mallinfo2, malloc_info)",
)
def test_make_heap_room_trims_free_chunks_too_small_for_the_next_block():
    """Under retain_host_memory a freed 200 MiB aligned block, kept off the heap's top by a live allocation,
    stays resident. A block of the same size does not count as fitting the chunk it left (an aligned
    allocation needs its alignment and a header more; whether the chunk has them depends on what its
    neighbours did, so fits() asks for slack): before it make_heap_room hands the free chunks' pages back;
    before a 150 MiB block, which fits, it leaves them. After the trim the freed block's chunk is held out of
    play, so a smaller block later does not fault its pages in again. In a child process: mallopt is
    process-wide."""
    run = subprocess.run(
        [sys.executable, "-c", _HEAP_ROOM_CHILD], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    assert 200 * mib <= out["largest"] < 201 * mib
    assert out["fits_150"] and not out["fits_200"]
    assert out["room_150"] is False and abs(out["kept"]) < 16 * mib
    assert out["room_200"] is True and out["released"] > 180 * mib
    assert out["largest_after"] < 100 * mib and not out["smaller_in_old_chunk"]
    assert out["room_200_small_free"] is False


def test_make_heap_room_leaves_a_heap_whose_top_nearly_holds_the_block(monkeypatch):
    """One block size repeating: each call's block goes back to the heap's top, so the next one grows the heap
    by the top's shortfall only (the aligned allocation's slack). Trimming the free chunks elsewhere then would
    hand back pages that later calls fault in again (a full-size DLRMv3 step went 400 -> 507 ms when it did),
    so make_heap_room leaves them; a top far too small for the block still gets them trimmed first, and the
    largest free chunk held."""
    import recir.embedding._huge_pages as hp

    mib = 1 << 20
    trims: list[int] = []
    held: list[int] = []
    monkeypatch.setattr(hp, "trim_host_heap", lambda: trims.append(1) or True)
    monkeypatch.setattr(hp, "_hold_free_chunk", held.append)
    near = hp.HeapFree(largest=200 * mib, top=200 * mib + (64 << 10), free=600 * mib)
    monkeypatch.setattr(hp, "host_heap_free", lambda: near)
    assert not near.fits(200 * mib) and 0 < near.growth(200 * mib) < 2 * mib
    assert hp.make_heap_room(200 * mib) is False and not trims
    far = hp.HeapFree(largest=200 * mib, top=72 * mib, free=600 * mib)
    monkeypatch.setattr(hp, "host_heap_free", lambda: far)
    assert far.growth(200 * mib) == 129 * mib
    assert hp.make_heap_room(200 * mib) is True and trims == [1]
    assert held == [200 * mib]  # the chunk too small for the block, held out of play after the trim
    fits = hp.HeapFree(largest=300 * mib, top=0, free=600 * mib)
    assert fits.fits(200 * mib) and fits.growth(200 * mib) == 0
