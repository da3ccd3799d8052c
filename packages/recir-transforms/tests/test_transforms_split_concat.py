"""recir-split-concat-products: what it rewrites, the values it keeps (fp32 and bf16), what it leaves alone."""

from __future__ import annotations

import torch
from _transforms_stepgraphs import trace_step
from recir.transforms import SplitConcatProducts, verify

_aten = torch.ops.aten


def _projection_step(dtype: torch.dtype = torch.float32, bias: bool = True, weight_grad: bool = False):
    """An HSTU-like output projection: x + concat[u, silu(a), u * a] @ W (+ b), a forward-only step; with
    ``weight_grad`` also the product a training step's weight gradient takes of the concatenation."""

    def fn(state, batch):
        w, b = state
        x, u, a = batch
        parts = [u, torch.nn.functional.silu(a), u * a]
        cat = torch.cat(parts, dim=-1).view(-1, 9)
        out = torch.addmm(b, cat, w) if bias else cat @ w
        outputs = [x + out.view(2, 5, 4)]
        if weight_grad:
            outputs.append(cat.t() @ out)
        return [w, b], outputs

    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    return trace_step(
        fn,
        {"param:w": ("param", rnd(9, 4)), "param:b": ("param", rnd(4))},
        {"x": ("dense", rnd(2, 5, 4)), "u": ("dense", rnd(2, 5, 3)), "a": ("dense", rnd(2, 5, 3))},
        ["y", "dw"] if weight_grad else ["y"],
    )


def _count(step, target):
    return sum(1 for n in step.graph.nodes if n.target is target)


def test_split_concat_products_rewrites_the_product_of_a_concatenation_and_keeps_its_values():
    for bias in (True, False):
        step, state, batch = _projection_step(bias=bias)
        want = step(state, batch)[1]
        result = SplitConcatProducts().run(step)
        assert result.changed and result.stats == {"split": 1}
        verify(step)
        assert _count(step, _aten.cat.default) == 0
        assert _count(step, _aten.mm.default) + _count(step, _aten.addmm.default) == 3
        assert _count(step, _aten.addmm.default) == (1 if bias else 0)  # the bias goes in once
        got = step(state, batch)[1]
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_split_concat_products_adds_low_precision_parts_in_float32_and_rounds_once():
    step, state, batch = _projection_step(dtype=torch.bfloat16)
    want = step(state, batch)[1][0]
    assert SplitConcatProducts().run(step).changed
    verify(step)
    out = step(state, batch)[1][0]
    assert out.dtype == torch.bfloat16
    # the sum in float32, then one rounding: at most one bf16 unit from the single product's value
    torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=2**-7)
    adds = [n for n in step.graph.nodes if n.target is _aten.add.Tensor and n.meta["val"].dim() == 2]
    assert adds and all(n.meta["val"].dtype == torch.float32 for n in adds)


def test_split_concat_products_leaves_a_concatenation_that_another_product_reads():
    step, _, _ = _projection_step(weight_grad=True)
    before = step.format_graph()
    result = SplitConcatProducts().run(step)
    assert not result.changed and result.stats == {"split": 0}
    assert step.format_graph() == before
