"""recir-cleanup-cse: snapshot, numerics (params and optimizer state), phases, random ops, state outputs."""

from __future__ import annotations

import pytest
import torch
from _transforms_stepgraphs import mark_phase, mlp_sgd_step, run_steps, trace_step
from recir.transforms import (
    CommonSubexpressionElimination,
    Pipeline,
    VerificationError,
    parse_pipeline,
    verify,
)


def _dup_step():
    def fn(state, batch):
        (w,), (x,) = state, batch
        loss = ((x @ w) + (x @ w)).sum()
        mark_phase("backward")
        recomputed = (x @ w).sum()  # a recomputation: same op as the forward mm, later phase
        mark_phase("optimizer")
        return [w - 0.1 * recomputed], [loss]

    return trace_step(
        fn, {"param:w": ("param", torch.randn(4, 2))}, {"x": ("dense", torch.randn(3, 4))}, ["loss"]
    )


def test_cse_snapshot_keeps_phases_apart():
    step, _, _ = _dup_step()
    assert (
        step.format_graph()
        == """\
%param_w = input
%x = input
%mm = aten.mm(%x, %param_w)  # forward
%mm_1 = aten.mm(%x, %param_w)  # forward
%add = aten.add.Tensor(%mm, %mm_1)  # forward
%sum_1 = aten.sum(%add)  # forward
%mm_2 = aten.mm(%x, %param_w)  # backward
%sum_2 = aten.sum(%mm_2)  # backward
%mul = aten.mul.Tensor(%sum_2, 0.1)  # optimizer
%sub = aten.sub.Tensor(%param_w, %mul)  # optimizer
return [%sub, %sum_1]"""
    )
    result = CommonSubexpressionElimination().run(step)
    assert result.changed and result.stats == {"merged": 1, "forward": 1}
    assert (
        step.format_graph()
        == """\
%param_w = input
%x = input
%mm = aten.mm(%x, %param_w)  # forward
%add = aten.add.Tensor(%mm, %mm)  # forward
%sum_1 = aten.sum(%add)  # forward
%mm_2 = aten.mm(%x, %param_w)  # backward
%sum_2 = aten.sum(%mm_2)  # backward
%mul = aten.mul.Tensor(%sum_2, 0.1)  # optimizer
%sub = aten.sub.Tensor(%param_w, %mul)  # optimizer
return [%sub, %sum_1]"""
    )
    verify(step, level=2)
    # opting in, the backward recomputation reuses the forward value (an earlier phase)
    result = CommonSubexpressionElimination(cross_phase=True).run(step)
    assert result.stats == {"merged": 1, "backward": 1}
    assert "%sum_2 = aten.sum(%mm)  # backward" in step.format_graph()
    verify(step, level=2)


def test_cse_numerics_on_an_autograd_step():
    def fn(state, batch):
        (w, m), (x, y) = state, batch
        w = w.detach().requires_grad_(True)
        pred = torch.tanh(x @ w) + torch.tanh(x @ w)  # duplicated forward, hence duplicated backward
        loss = ((pred - y) ** 2).mean()
        outputs = [loss.detach()]
        mark_phase("backward")
        (g,) = torch.autograd.grad(loss, [w])
        mark_phase("optimizer")
        new_m = 0.9 * m + g
        return [(w - 0.1 * new_m).detach(), new_m], outputs

    g = torch.Generator().manual_seed(0)
    state = {
        "param:w": ("param", torch.randn(4, 2, generator=g)),
        "optim:w:momentum": ("optim", torch.zeros(4, 2)),
    }
    batch = {"x": ("dense", torch.randn(3, 4, generator=g)), "y": ("label", torch.randn(3, 2, generator=g))}
    step, s, b = trace_step(fn, state, batch, ["loss"])
    ref, _, _ = trace_step(fn, state, batch, ["loss"])
    pipe = parse_pipeline("recir-cleanup-cse,recir-cleanup-dce")
    out = pipe.run(step)
    assert pipe.records[0].stats["merged"] >= 3  # mm + tanh in forward, and their backward twins
    assert pipe.records[0].stats.get("backward", 0) >= 1
    a_state, a_out = run_steps(out, s, b, n=3)
    b_state, b_out = run_steps(ref, s, b, n=3)
    for x, y in zip(a_state, b_state):  # the parameter and the momentum buffer
        torch.testing.assert_close(x, y)
    torch.testing.assert_close(a_out, b_out)


def test_cse_never_merges_random_ops_or_state_buffers():
    def fn(state, batch):
        (w, _a, _b), (x,) = state, batch
        noise = torch.rand_like(x) + torch.rand_like(x)
        loss = (x * noise).sum() + (x @ w).sum()
        mark_phase("optimizer")
        return [w * 0.5, torch.zeros(2), torch.zeros(2)], [loss]  # two slots reset to the same value

    state = {
        "param:w": ("param", torch.randn(4, 2)),
        "buffer:a": ("buffer", torch.ones(2)),
        "buffer:b": ("buffer", torch.ones(2)),
    }
    step, _, _ = trace_step(fn, state, {"x": ("dense", torch.randn(3, 4))}, ["loss"])
    result = CommonSubexpressionElimination().run(step)
    assert not result.changed and result.stats == {"merged": 0}
    targets = [n.target for n in step.graph.nodes]
    assert targets.count(torch.ops.aten.rand_like.default) == 2
    assert targets.count(torch.ops.aten.zeros.default) == 2
    verify(step, level=2)


def test_cse_negative_nothing_to_merge():
    step, _, _ = mlp_sgd_step()
    out = Pipeline([CommonSubexpressionElimination()]).run(step)
    assert out.graph is step.graph and not out.meta
    assert (
        str(Pipeline([CommonSubexpressionElimination(cross_phase=True)]))
        == "recir-cleanup-cse{cross_phase=true}"
    )


class _BrokenCse(CommonSubexpressionElimination):
    """Deliberately broken: merges random draws like any other op (the numerics test must catch it)."""

    name = "recir-test-broken-cse"

    @staticmethod
    def _mergeable(node):
        return node.op == "call_function"


class _BrokenCseAcrossPhases(CommonSubexpressionElimination):
    """Deliberately broken: merges a forward node into an identical *later* backward one."""

    name = "recir-test-broken-cse-phases"

    def run(self, step):
        mm, mm_2 = (n for n in step.graph.nodes if n.name in ("mm", "mm_2"))
        mm.append(mm_2)  # hoist the backward twin (it reads only placeholders), keep its phase
        mm.replace_all_uses_with(mm_2)
        step.graph.erase_node(mm)
        return super().run(step)


def test_cse_broken_variants_are_caught():
    def fn(state, batch):
        (w,), (x,) = state, batch
        a, b = torch.rand_like(x), torch.rand_like(x)
        return [w * 1.0], [(a - b).abs().sum()]

    step, s, bt = trace_step(
        fn, {"param:w": ("param", torch.randn(4, 2))}, {"x": ("dense", torch.randn(3, 4))}, ["loss"]
    )
    assert step([s[0]], bt)[1][0] > 0
    broken = Pipeline([_BrokenCse()]).run(step)
    assert broken([s[0]], bt)[1][0] == 0  # two draws became one: exactly what the real CSE refuses

    step, _, _ = _dup_step()
    with pytest.raises(VerificationError) as info:
        Pipeline([_BrokenCseAcrossPhases()], verify_level=2).run(step)
    assert info.value.invariant == "INV-5" and info.value.transform == "recir-test-broken-cse-phases"
