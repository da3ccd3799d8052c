"""recir-cleanup-narrow: a slice of the last rows moves up through a small attention layer (products on
merged [B*T, D] rows, a split, a norm, a mask from iotas, a concatenation), the narrowed step computes
the same values with fewer rows, values also read whole are sliced where they are read, and what it
must not touch stays."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _transforms_stepgraphs import trace_step
from recir.transforms import Narrow, get_transform, verify

_aten = torch.ops.aten
B, T, D, C = 3, 7, 4, 2  # batch, tokens, width, kept (last) rows


def _layer(state, batch, keep_whole=False):
    w_qkv, w_out, ln_w, ln_b = state
    (x,) = batch
    h = F.layer_norm(x, (D,), ln_w, ln_b)
    q, k, v = (h.reshape(B * T, D) @ w_qkv).view(B, T, 3 * D).split(D, dim=-1)
    mask = (torch.arange(T)[None, :] <= torch.arange(T)[:, None]).float()  # causal, from iotas
    scores = F.silu(q @ k.transpose(1, 2)) * mask
    att = scores @ v
    y = x + (torch.cat([att, q * att], dim=-1).reshape(B * T, 2 * D) @ w_out).view(B, T, D)
    outputs = [y[:, T - C :]]
    if keep_whole:
        outputs.append(y.sum())  # y is read whole too: nothing to narrow above the output slice
    return list(state), outputs


def _step(keep_whole=False):
    g = torch.Generator().manual_seed(0)
    state = {
        "param:w_qkv": ("param", torch.randn(D, 3 * D, generator=g)),
        "param:w_out": ("param", torch.randn(2 * D, D, generator=g)),
        "param:ln_w": ("param", torch.randn(D, generator=g)),
        "param:ln_b": ("param", torch.randn(D, generator=g)),
    }
    names = ["last_rows", "total"] if keep_whole else ["last_rows"]
    return trace_step(
        lambda s, b: _layer(s, b, keep_whole),
        state,
        {"x": ("dense", torch.randn(B, T, D, generator=g))},
        names,
    )


def _rows(step, target):
    return [tuple(n.meta["val"].shape) for n in step.graph.nodes if n.target is target]


def test_narrow_computes_the_kept_rows_only_with_the_same_values():
    step, state, batch = _step()
    _, expected = step(state, batch)
    assert _rows(step, _aten.mm.default) == [(B * T, 3 * D), (B * T, D)]
    result = Narrow().run(step)
    assert result.changed and result.stats["narrowed"] > 10
    verify(result.step)
    # the projection stays whole (its k and v feed every query); the output product and the
    # queries' attention run on the kept rows; the iota mask is sliced, not materialised whole
    assert _rows(step, _aten.mm.default) == [(B * T, 3 * D), (B * C, D)]
    assert _rows(step, _aten.bmm.default) == [(B, C, T), (B, C, D)]
    vals = [n.meta["val"] for n in step.graph.nodes if n.op == "call_function"]
    assert all(v.shape[-2:] != (T, T) for v in vals if isinstance(v, torch.Tensor))
    _, got = step(state, batch)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=1e-6)
    assert get_transform("recir-cleanup-narrow") is Narrow


def test_narrow_leaves_values_that_are_also_read_whole():
    step, state, batch = _step(keep_whole=True)
    _, expected = step(state, batch)
    before = step.format_graph()
    result = Narrow().run(step)
    assert not result.changed and step.format_graph() == before
    _, got = step(state, batch)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_narrow_ignores_strided_and_whole_slices_and_inputs_needed_both_ways():
    def fn(state, batch):
        (w,) = state
        (x,) = batch
        y = torch.sigmoid(x @ w)
        t = torch.tanh(w)
        sq = t @ t  # rows of the product need t narrowed as the first operand and whole as the second
        return [w], [y[::2], y[:, 0:], y[:, :], sq[1:3]]

    step, state, batch = trace_step(
        fn,
        {"param:w": ("param", torch.randn(4, 4))},
        {"x": ("dense", torch.randn(6, 4))},
        ["a", "b", "c", "d"],
    )
    _, expected = step(state, batch)
    before = step.format_graph()
    assert not Narrow().run(step).changed
    assert step.format_graph() == before
    _, got = step(state, batch)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _two_pieces(state, batch):
    """A history piece and a candidate piece concatenated along the tokens, one projection over both,
    and readers of each piece's rows apart (as a cached-history split leaves a layer)."""
    (w,) = state
    a, b = batch
    x = torch.cat([a, b], dim=1)  # [B, T, D]
    h = F.silu((F.layer_norm(x, (D,)).reshape(B * T, D) @ w).view(B, T, D))
    return list(state), [h[:, : T - C] * 2.0, h[:, T - C :].sum(dim=-1)]


def test_narrow_split_computes_disjoint_row_ranges_apart_through_a_concatenation():
    g = torch.Generator().manual_seed(1)
    state = {"param:w": ("param", torch.randn(D, D, generator=g))}
    pieces = {
        "a": ("dense", torch.randn(B, T - C, D, generator=g)),
        "b": ("dense", torch.randn(B, C, D, generator=g)),
    }
    step, st, batch = trace_step(_two_pieces, state, pieces, ["history", "candidates"])
    _, expected = step(st, batch)
    plain = step.copy()
    # without split the product is read as two ranges: it stays whole (the concatenation too)
    assert Narrow().run(plain).stats.get("split", 0) == 0
    assert _rows(plain, _aten.mm.default) == [(B * T, D)]
    result = Narrow(split=True).run(step)
    verify(result.step)
    assert result.stats["split"] > 0
    assert sorted(_rows(step, _aten.mm.default)) == sorted([(B * (T - C), D), (B * C, D)])
    assert not _rows(step, _aten.cat.default)  # each piece's rows straight from its own input
    _, got = step(st, batch)
    for g_, e in zip(got, expected):
        torch.testing.assert_close(g_, e, rtol=1e-6, atol=1e-6)
