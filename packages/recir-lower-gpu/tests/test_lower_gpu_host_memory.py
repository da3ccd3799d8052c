"""retain_host_memory: freed step buffers keep their pages, so a repeated step takes no page faults."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# A step-like allocation pattern: eight 4 MiB (or 48 MiB: XLA's sizes) buffers touched, then all freed,
# four times. With glibc's defaults the memory goes back to the OS after a round (unmapped, or trimmed off
# the heap), so later rounds fault their pages in again (measured: 8160 of 8192 in most rounds; glibc's
# dynamic mmap threshold makes an occasional round reuse heap pages, 1024 faults). Kept, later rounds reuse
# the first's pages; small allocations that stay alive between rounds (thread pools, caches) can split the
# free space so that a round after the first places some buffers on fresh pages (measured: 0, 1024 or 4096
# faults in a round here, 5120 once on a CI machine) before the layout settles. So the test compares the
# loudest later round of the default with the quietest of retain.
_SCRIPT = """
import resource, sys
import torch
if sys.argv[1] == "retain":
    from recir.lower_gpu import retain_host_memory
    assert retain_host_memory()
numel = int(sys.argv[2])
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bufs = [torch.empty(numel).fill_(1.0) for _ in range(8)]
    del bufs
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults[1:])
"""


def _later_round_faults(mode: str, mib: int) -> list[int]:
    args = [sys.executable, "-c", _SCRIPT, mode, str(mib << 18)]  # float32: 2**18 elements per MiB
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return [int(n) for n in out.stdout.split()[-3:]]


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
@pytest.mark.parametrize("mib", [4, 48])  # below and above glibc's largest mmap threshold (32 MiB)
def test_retained_memory_is_reused_without_page_faults(mib):
    pages = 8 * (mib << 20) // 4096  # per round
    assert max(_later_round_faults("system", mib)) > pages * 3 // 4  # glibc's default returned the memory
    assert min(_later_round_faults("retain", mib)) < pages // 4  # kept: a later round reuses the pages


def test_retain_host_memory_rejects_bad_sizes():
    from recir.lower_gpu import retain_host_memory

    with pytest.raises(ValueError, match="mmap_threshold_mib=64 is outside"):
        retain_host_memory(mmap_threshold_mib=64)
    with pytest.raises(ValueError, match="top_pad_mib=-1"):
        retain_host_memory(top_pad_mib=-1)
