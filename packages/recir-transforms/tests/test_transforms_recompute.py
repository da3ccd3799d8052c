"""recir-recompute-activations: policies, placement, bit-equal numerics (parameters and optimizer state),
the transient peak it lowers, random ops, bad options."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from _transforms_stepgraphs import mark_phase, run_steps, trace_step
from recir.transforms import (
    PHASE_KEY,
    RECOMPUTE_KEY,
    SCOPE_KEY,
    ConfigError,
    Pipeline,
    Recompute,
    StepGraph,
    transient_peak_bytes,
    verify,
)
from torch.fx.experimental.proxy_tensor import get_proxy_mode

_SCOPE = [""]


def mark_scope(scope: str) -> None:
    """While tracing: the nodes created from here on belong to module path ``scope`` (recir.scope)."""
    mode = get_proxy_mode()
    if mode is not None:
        _tag(mode.tracer.graph, _SCOPE[0])
        _SCOPE[0] = scope


def _tag(graph: fx.Graph, scope: str) -> None:
    for node in graph.nodes:
        if node.op == "call_function" and SCOPE_KEY not in node.meta:
            node.meta[SCOPE_KEY] = scope


def _layers_step(width: int = 64, batch: int = 32, dropout: bool = False, layers: int = 2):
    """Tanh layers with a length mask, a head, momentum SGD: ``layers.0``, ``layers.1``, ..., ``head``."""
    names = [*(f"w{i}" for i in range(layers)), "wh"]

    def fn(state, data):
        (x, lengths, y) = data
        params = [w.detach().requires_grad_(True) for w in state[: len(names)]]
        h = x
        mark_scope("layers.0")
        for i in range(layers):
            if i:
                mark_scope(f"layers.{i}")
            keep = (torch.arange(width)[None, :] < lengths[:, None]).to(h.dtype)  # from the batch alone
            a = torch.tanh(h @ params[i]) * keep
            if dropout:
                a = a * (torch.rand_like(a) > 0.25).to(a.dtype)
            h = h + a * a
        mark_scope("head")
        loss = ((h @ params[-1] - y) ** 2).mean()
        mark_scope("")
        mark_phase("backward")
        grads = torch.autograd.grad(loss, params)
        mark_phase("optimizer")
        moms = [0.9 * m + g for m, g in zip(state[len(names) :], grads)]
        new = [(p - 0.1 * m).detach() for p, m in zip(params, moms)]
        return [*new, *moms], [loss.detach()]

    g = torch.Generator().manual_seed(0)
    state = {f"param:{n}": ("param", torch.randn(width, width, generator=g) / width**0.5) for n in names[:-1]}
    state["param:wh"] = ("param", torch.randn(width, 4, generator=g) / width**0.5)
    for n in names:
        state[f"optim:{n}:momentum"] = ("optim", torch.zeros_like(state[f"param:{n}"][1]))
    data = {
        "x": ("dense", torch.randn(batch, width, generator=g)),
        "lengths": ("dense", torch.randint(1, width, (batch,), generator=g)),
        "y": ("label", torch.randn(batch, 4, generator=g)),
    }
    _SCOPE[0] = ""
    step, s, b = trace_step(fn, state, data, ["loss"])
    _tag(step.graph, _SCOPE[0])
    return step, s, b


def _backward_reads_of_forward(step: StepGraph, prefix: str) -> list[fx.Node]:
    return [
        n
        for n in step.graph.nodes
        if n.meta.get(PHASE_KEY) == "forward"
        and str(n.meta.get(SCOPE_KEY, "")).startswith(prefix)
        and any(u.meta.get(PHASE_KEY) == "backward" for u in n.users)
    ]


def _bitwise_equal(a: StepGraph, b: StepGraph, state, batch) -> None:
    torch.manual_seed(0)  # the same draws for a step with random ops
    a_state, a_out = run_steps(a, state, batch, n=3)
    torch.manual_seed(0)
    b_state, b_out = run_steps(b, state, batch, n=3)
    for x, y in zip(a_state, b_state):  # parameters and momentum buffers
        assert torch.equal(x, y)
    assert all(torch.equal(x, y) for x, y in zip(a_out, b_out))


def test_recompute_layers_moves_every_kept_value_into_the_backward_bit_for_bit():
    step, state, batch = _layers_step()
    ref = step.copy()
    assert _backward_reads_of_forward(step, "layers.")  # tanh outputs, masks, a*a's input
    before = transient_peak_bytes(step)
    pipe = Pipeline([Recompute(modules=("layers.*",))], name="t")
    out = pipe.run(step)
    verify(out, level=2)
    stats = pipe.records[0].stats
    assert stats["regions"] == 2 and stats["recomputed_nodes"] > 0
    assert stats["peak_bytes_before"] == before and stats["peak_bytes_after"] < before
    # what stays alive for the backward: each layer's output (the next one's input), nothing inside
    kept = _backward_reads_of_forward(out, "layers.")
    assert len(kept) == 2, [n.name for n in kept]
    for node in kept:
        assert any(
            u.meta[PHASE_KEY] == "forward" and u.meta[SCOPE_KEY] != node.meta[SCOPE_KEY] for u in node.users
        )
    barriers = [n for n in out.graph.nodes if n.target is torch.ops.recir.recompute_barrier.default]
    assert len(barriers) == 2
    for barrier in barriers:
        assert barrier.meta[PHASE_KEY] == "backward" and barrier.meta[RECOMPUTE_KEY].startswith("layers.")
        anchor = barrier.args[0][-1]  # the copies wait for a backward value
        assert anchor.meta[PHASE_KEY] == "backward"
        copies = [n for n in out.graph.nodes if n.meta.get(RECOMPUTE_KEY) == barrier.meta[RECOMPUTE_KEY]]
        order = {n: i for i, n in enumerate(out.graph.nodes)}
        first_reader = min((u for c in copies for u in c.users if RECOMPUTE_KEY not in u.meta), key=order.get)
        assert all(order[c] < order[first_reader] for c in copies)  # right before the first reader...
        assert all(order[c] > order[anchor] for c in copies)  # ...and after the backward value
    _bitwise_equal(out, ref, state, batch)


def test_recompute_cost_keeps_products_and_recomputes_what_is_cheaper_than_keeping():
    step, state, batch = _layers_step()
    ref = step.copy()
    pipe = Pipeline([Recompute(policy="cost")], name="t")
    out = pipe.run(step)
    verify(out, level=2)
    assert pipe.records[0].status == "changed"
    copied = [n for n in out.graph.nodes if RECOMPUTE_KEY in n.meta and n.target is not operator.getitem]
    # the masks are recomputed from the batch's lengths (free: inputs stay alive anyway)...
    assert any(n.target is torch.ops.aten.lt.Tensor for n in copied)
    # ...and no product is redone
    assert not any(n.target is torch.ops.aten.mm.default for n in copied)
    assert pipe.records[0].stats["peak_bytes_after"] <= pipe.records[0].stats["peak_bytes_before"]
    _bitwise_equal(out, ref, state, batch)


def test_recompute_budget_takes_regions_until_the_peak_fits():
    step, _, _ = _layers_step(width=32, batch=256, layers=3)
    full = transient_peak_bytes(step)
    peaks = [
        transient_peak_bytes(Recompute(modules=(f"layers.[0-{k}]",))(step.copy()).step) for k in range(3)
    ]
    assert full > peaks[0] > peaks[1], (full, peaks)  # the last layer's copies bound the third
    result = Recompute(policy="budget", modules=("layers.*",), budget_bytes=full)(step.copy())
    assert not result.changed and result.stats["budget_met"]
    result = Recompute(policy="budget", modules=("layers.*",), budget_bytes=peaks[1])(step.copy())
    assert result.stats["regions"] == 2 and result.stats["peak_bytes_after"] == peaks[1]
    assert result.stats["budget_met"]
    result = Recompute(policy="budget", modules=("layers.*",), budget_bytes=0)(step.copy())
    assert result.stats["regions"] == 3 and not result.stats["budget_met"]  # as low as it goes, said so


def test_recompute_never_redraws_random_values():
    step, state, batch = _layers_step(dropout=True)
    ref = step.copy()
    out = Recompute(modules=("layers.*",))(step).step
    verify(out, level=2)
    rands = [n for n in out.graph.nodes if n.target is torch.ops.aten.rand_like.default]
    assert len(rands) == 2 and all(n.meta[PHASE_KEY] == "forward" for n in rands)
    assert all(RECOMPUTE_KEY not in n.meta for n in rands)
    _bitwise_equal(out, ref, state, batch)


def test_recompute_bad_options_say_what_to_pass():
    step, _, _ = _layers_step()
    with pytest.raises(ConfigError, match="policy='layers' is not a policy.*regions, cost, budget"):
        Recompute(policy="layers")(step)
    with pytest.raises(ConfigError, match="non-empty tuple of module-path patterns"):
        Recompute(modules="layers.*")(step)
    with pytest.raises(ConfigError, match="the budget policy takes budget_bytes"):
        Recompute(policy="budget")(step)
    with pytest.raises(ConfigError, match="the budget policy takes budget_bytes"):
        Recompute(budget_bytes=10)(step)

    def serving(state, data):
        ((w,), (x,)) = state, data
        return [w], [torch.tanh(x @ w)]

    inference, _, _ = trace_step(
        serving, {"param:w": ("param", torch.ones(2, 2))}, {"x": ("dense", torch.ones(1, 2))}, ["y"]
    )
    with pytest.raises(ConfigError, match="no backward phase"):
        Recompute()(inference)
