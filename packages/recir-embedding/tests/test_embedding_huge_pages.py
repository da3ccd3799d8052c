"""recir.embedding.advise_huge_pages: large host buffers backed by transparent huge pages, values kept."""

from __future__ import annotations

import pytest
import torch
from recir.embedding import advise_huge_pages, advise_large_buffers, huge_page_bytes, huge_pages_supported

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
