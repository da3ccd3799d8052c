"""The curated decomposition table: never a forward decomposed without its backward (the SDPA trap)."""

from __future__ import annotations

import pytest
import torch
from recir.capture import (
    CaptureError,
    capture_decompositions,
    capture_train_step,
    check_decomposition_table,
    testing,
)
from torch._decomp import core_aten_decompositions


def test_capture_decomp_rejects_forward_without_backward() -> None:
    # core ATen decomposes the CPU flash-attention forward but not its backward
    with pytest.raises(CaptureError, match="_scaled_dot_product_flash_attention_for_cpu") as exc:
        check_decomposition_table(core_aten_decompositions())
    assert "Fix:" in str(exc.value)


def test_capture_decomp_table_is_consistent() -> None:
    table = capture_decompositions()
    check_decomposition_table(table)
    names = {op.name() for op in table if isinstance(op, torch._ops.OpOverload)}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in names
    assert "aten::index_add" not in names  # recir-embedding pattern-matches it
    assert not any(
        torch.Tag.nondeterministic_seeded in op.tags for op in table if isinstance(op, torch._ops.OpOverload)
    )


@pytest.mark.parametrize("causal", [True, False])
def test_capture_decomp_sdpa_gradients_match_eager(causal: bool) -> None:
    """Eager runs the fused CPU flash kernel; the captured step must give the same gradients."""

    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)
            self.out = torch.nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).reshape(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return self.out(a.transpose(1, 2).reshape(2, 5, 8)).mean(1).squeeze(-1)

    torch.manual_seed(0)
    model = Attn()
    case = testing.REFERENCE_CASES["transformer"]
    batch = {"x": torch.randn(2, 5, 8), "y": torch.randn(2)}
    step = capture_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), case.loss_fn, batch)
    targets = {str(n.target) for n in step.graph.nodes}
    assert not any("flash_attention" in t for t in targets), targets
    grads = testing.captured_gradients(step, step.init_state(model), batch)
    ref = testing.eager_gradients(model, case.loss_fn, batch)
    assert set(grads) == set(ref)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
