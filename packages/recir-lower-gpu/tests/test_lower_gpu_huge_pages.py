"""GPUOptions.huge_pages_min_bytes: large CPU state tensors backed by transparent huge pages, same training."""

from __future__ import annotations

import pytest
import recir.lower_gpu as lg
import torch
from _lower_gpu_steps import TinyMLP, mlp_batch, mse_loss, sgd_step_graph
from recir.embedding import huge_page_bytes, huge_pages_supported


@pytest.mark.skipif(not huge_pages_supported(), reason="needs Linux 6.1+ with transparent huge pages")
def test_large_state_tensors_get_huge_pages_and_train_bit_for_bit_the_same(lower_gpu_cache_dir):
    torch.manual_seed(0)
    model = TinyMLP(hidden=1 << 18)  # first weight 262144 x 8 fp32: 8 MiB (and its momentum)
    step = sgd_step_graph(model, mse_loss, mlp_batch(0), lr=0.05, momentum=0.9)
    results = []
    for min_bytes in (None, 4 << 20):
        options = lg.GPUOptions(cache_dir=lower_gpu_cache_dir, huge_pages_min_bytes=min_bytes)
        compiled = lg.compile(step, device="cpu", options=options)
        state = compiled.init_state(model, None)
        for i in range(3):
            state, _ = compiled(state, mlp_batch(i))
        large = [t for t in state if t.nbytes >= 4 << 20]
        assert len(large) == 2  # the weight and its momentum buffer
        results.append((compiled.state_dict(state), [huge_page_bytes(t.data_ptr(), t.nbytes) for t in large]))
    assert all(b >= 2 << 20 for b in results[1][1]), results[1][1]  # still there after in-place steps
    for name, value in results[0][0].items():
        assert torch.equal(results[1][0][name], value), name
