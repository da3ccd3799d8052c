"""TPUOptions.huge_pages_min_bytes: large state buffers on JAX's CPU backend backed by transparent huge
pages, kept across donated steps, same training."""

from __future__ import annotations

import pytest
import torch
from recir.embedding import huge_page_bytes, huge_pages_supported
from recir.lower_tpu import TPUOptions, compile
from torch import nn

pytestmark = pytest.mark.tpu


def _mse(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


@pytest.mark.skipif(not huge_pages_supported(), reason="needs Linux 6.1+ with transparent huge pages")
def test_large_state_buffers_get_huge_pages_across_donated_steps(sgd_step):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 1 << 18), nn.ReLU(), nn.Linear(1 << 18, 1))  # 8 MiB first weight
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 1, generator=g)} for _ in range(3)]
    step = sgd_step(model, _mse, batches[0], lr=0.05)
    results = []
    for min_bytes in (None, 4 << 20):
        compiled = compile(step, options=TPUOptions(huge_pages_min_bytes=min_bytes))
        state = compiled.init_state(model)
        for batch in batches:
            state, _ = compiled(state, batch)
        shards = [s.data for x in state for s in x.addressable_shards if s.data.nbytes >= 4 << 20]
        assert len(shards) == 1
        results.append(
            (
                compiled.state_dict(state),
                [huge_page_bytes(s.unsafe_buffer_pointer(), s.nbytes) for s in shards],
            )
        )
    assert all(b >= 2 << 20 for b in results[1][1]), results[1][1]  # donation kept the advised buffer
    for name, value in results[0][0].items():
        assert torch.equal(results[1][0][name], value), name
