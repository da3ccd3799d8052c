"""recir-split-candidate-attention and ``cached_history``: a serving graph with ``recir::hstu_attention`` in
every layer split into a history graph (-> every layer's history keys and values) and a candidate graph
(cache + batch -> the output), which together equal the serving graph; torch only (no capture, no DLRMv3)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _transforms_stepgraphs import trace_step
from recir.transforms import (
    CACHED_HISTORY_KEY,
    ConfigError,
    SplitCandidateAttention,
    cached_history,
    get_transform,
    verify,
)

B, P, C, D, H = 3, 6, 4, 8, 2  # users, history slots, candidate slots, width, heads
N, A = P + C, D // H
_HSTU = torch.ops.recir.hstu_attention.default
_aten = torch.ops.aten


def _serving(state, batch, attention=True):
    """Two layers of norm -> q/k/v projection -> HSTU attention -> output projection + residual, then the
    candidates' rows pooled: the shape of DLRMv3's STU stack, small."""
    x, valid, scale = batch
    for layer in range(2):
        w_qkv, w_out = state[2 * layer], state[2 * layer + 1]
        n = F.layer_norm(x, (D,))
        q, k, v = (n.reshape(B * N, D) @ w_qkv).view(B, N, 3 * D).split(D, dim=-1)
        q, k, v = (t.view(B, N, H, A).permute(0, 2, 1, 3) for t in (q, k, v))  # [B, H, N, A]
        if attention:
            att = torch.ops.recir.hstu_attention(q, k, v, valid, scale, P, 0.5, [0, 4, N])
        else:  # the same maths without the op: nothing to split
            att = F.silu(0.5 * q @ k.transpose(-1, -2)) @ v / scale
        y = att.permute(0, 2, 1, 3).reshape(B, N, D).reshape(B * N, D) @ w_out
        x = x + y.view(B, N, D)
    return list(state), [x[:, P:].sum(dim=-1)]


def _step(attention=True):
    g = torch.Generator().manual_seed(0)
    state = {}
    for layer in range(2):
        state[f"param:l{layer}.qkv"] = ("param", torch.randn(D, 3 * D, generator=g) / D**0.5)
        state[f"param:l{layer}.out"] = ("param", torch.randn(D, D, generator=g) / D**0.5)
    slot = torch.arange(N)
    hist, cand = torch.tensor([6, 2, 0]), torch.tensor([4, 1, 3])
    valid = (slot < hist[:, None]) | ((slot >= P) & (slot < P + cand[:, None]))
    batch = {
        "x": ("dense", torch.randn(B, N, D, generator=g)),
        "valid": ("other", valid),
        "scale": ("other", torch.tensor(float(N))),
    }
    return trace_step(lambda s, b: _serving(s, b, attention), state, batch, ["scores"])


def _state_for(graph, serving, state):
    """The state tensors ``graph`` takes (each split graph drops the slots it does not read)."""
    by_name = dict(zip((s.name for s in serving.signature.state), state))
    return [by_name[s.name] for s in graph.signature.state]


def _history_rows(step, target) -> list[int]:
    return [n.meta["val"].shape[0] for n in step.graph.nodes if n.target is target]


def test_split_graphs_equal_the_serving_graph_and_hold_their_own_rows():
    serving, state, batch = _step()
    _, (want,) = serving(state, batch)
    graphs = cached_history(serving)
    for g in (graphs.history, graphs.candidates):
        verify(g)
    assert graphs.cache == ("cache.0.keys", "cache.0.values", "cache.1.keys", "cache.1.values")
    assert graphs.history.meta[CACHED_HISTORY_KEY]["layers"] == 2
    _, cache = graphs.history(_state_for(graphs.history, serving, state), batch)
    assert [tuple(c.shape) for c in cache] == [(B, H, P, A)] * 4
    # the history graph needs no weight of the last layer's output projection
    assert "param:l1.out" not in [s.name for s in graphs.history.signature.state]
    _, (got,) = graphs.candidates(_state_for(graphs.candidates, serving, state), [*batch, *cache])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # the candidate graph's products run on the candidates' rows only, the history graph's on the history's
    assert set(_history_rows(graphs.candidates, _aten.mm.default)) == {B * C}
    assert set(_history_rows(graphs.history, _aten.mm.default)) == {B * P}
    assert not [n for n in graphs.candidates.graph.nodes if n.target is _HSTU]
    # the history's attention of layer 0 only: the last layer's history rows feed no cache value
    assert len([n for n in graphs.history.graph.nodes if n.target is _HSTU]) == 1
    # the serving graph itself is untouched
    assert len([n for n in serving.graph.nodes if n.target is _HSTU]) == 2


def test_padded_history_keys_do_not_reach_the_candidates():
    """Garbage in the padded history slots (user 1 has 2 of 6, user 2 none) changes no candidate score."""
    serving, state, batch = _step()
    graphs = cached_history(serving)
    hist_state, cand_state = (_state_for(g, serving, state) for g in (graphs.history, graphs.candidates))
    poisoned_x = batch[0].clone()
    poisoned_x[1, 2:P] = 1e3  # user 1's padded history slots
    poisoned_x[2, :P] = -1e3  # user 2 has no history
    _, cache = graphs.history(hist_state, batch)
    _, bad_cache = graphs.history(hist_state, [poisoned_x, *batch[1:]])
    for c in bad_cache:  # the cache holds padded history rows as zeros, whatever the slots held
        assert (c[1, :, 2:] == 0).all() and (c[2] == 0).all()
    _, (clean,) = graphs.candidates(cand_state, [*batch, *cache])
    _, (got,) = graphs.candidates(cand_state, [poisoned_x, *batch[1:], *bad_cache])
    torch.testing.assert_close(got[1:], clean[1:], rtol=1e-6, atol=1e-6)


def test_the_region_transform_rewrites_each_attention_with_candidates():
    serving, state, batch = _step()
    _, (want,) = serving(state, batch)
    step = serving.copy()
    result = get_transform("recir-split-candidate-attention")().run(step)
    assert isinstance(get_transform("recir-split-candidate-attention")(), SplitCandidateAttention)
    assert result.changed and result.stats["rewritten"] == 2
    verify(step)
    _, (got,) = step(state, batch)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    markers = [n for n in step.graph.nodes if n.target is torch.ops.recir.history_cache.default]
    assert [(n.args[1], n.args[2]) for n in markers] == [
        (0, "keys"),
        (0, "values"),
        (1, "keys"),
        (1, "values"),
    ]


def test_a_graph_without_the_op_is_a_config_error_naming_the_fix():
    serving, _, _ = _step(attention=False)
    with pytest.raises(ConfigError, match=r"no recir::hstu_attention with candidate slots.*Fix:"):
        cached_history(serving)
