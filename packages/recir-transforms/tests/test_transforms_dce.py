"""recir-cleanup-dce: snapshot, numerics, random ops, state outputs, match counts, pipeline."""

from __future__ import annotations

import pytest
import torch
from _transforms_stepgraphs import mark_phase, mlp_sgd_step, run_steps, trace_step
from recir.transforms import DeadCodeElimination, Pipeline, VerificationError, get_transform, verify


def _dead_step():
    def fn(state, batch):
        (w, frozen), (x,) = state, batch
        torch.exp(x)  # dead
        torch.rand_like(x)  # dead, but random
        y = (x @ w).relu().sum()
        (x * 2).t()  # a dead chain of two
        mark_phase("optimizer")
        return [w * 0.5, frozen], [y]

    state = {"param:w": ("param", torch.randn(4, 2)), "buffer:frozen": ("buffer", torch.ones(2))}
    return trace_step(fn, state, {"x": ("dense", torch.randn(3, 4))}, ["loss"])


def test_dce_snapshot_and_counts():
    step, _, _ = _dead_step()
    assert (
        step.format_graph()
        == """\
%param_w = input
%buffer_frozen = input
%x = input
%exp = aten.exp(%x)  # forward
%rand_like = aten.rand_like(%x, pin_memory=False)  # forward
%mm = aten.mm(%x, %param_w)  # forward
%relu = aten.relu(%mm)  # forward
%sum_1 = aten.sum(%relu)  # forward
%mul = aten.mul.Tensor(%x, 2)  # forward
%t = aten.t(%mul)  # forward
%mul_1 = aten.mul.Tensor(%param_w, 0.5)  # optimizer
return [%mul_1, %buffer_frozen, %sum_1]"""
    )
    result = DeadCodeElimination().run(step)
    assert result.changed and result.stats == {"removed": 3, "forward": 3}
    assert (
        step.format_graph()
        == """\
%param_w = input
%buffer_frozen = input
%x = input
%rand_like = aten.rand_like(%x, pin_memory=False)  # forward
%mm = aten.mm(%x, %param_w)  # forward
%relu = aten.relu(%mm)  # forward
%sum_1 = aten.sum(%relu)  # forward
%mul_1 = aten.mul.Tensor(%param_w, 0.5)  # optimizer
return [%mul_1, %buffer_frozen, %sum_1]"""
    )
    verify(step, level=2)
    # the random op goes only when asked; the frozen slot and its identity output always stay
    result = DeadCodeElimination(drop_random=True).run(step)
    assert result.stats == {"removed": 1, "forward": 1}
    assert [n.name for n in step.graph.nodes if n.op == "placeholder"] == ["param_w", "buffer_frozen", "x"]


@pytest.mark.smoke
def test_dce_numerics_match_the_untransformed_step():
    step, state, batch = _dead_step()
    ref, _, _ = _dead_step()
    out = Pipeline(["recir-cleanup-dce"]).run(step)
    a_state, a_out = run_steps(out, state, batch)
    b_state, b_out = run_steps(ref, state, batch)
    for a, b in zip(a_state, b_state):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(a_out, b_out)


def test_dce_negative_nothing_dead():
    step, _, _ = mlp_sgd_step()
    before = step.format_graph()
    result = DeadCodeElimination().run(step)
    assert not result.changed and result.stats == {"removed": 0}
    assert step.format_graph() == before
    assert get_transform("recir-cleanup-dce") is DeadCodeElimination


class _BrokenDce(DeadCodeElimination):
    """Deliberately broken: 'cleans up' the last new-state output too (the verifier must catch it)."""

    name = "recir-test-broken-dce"

    def run(self, step):
        out = step.graph.output_node()
        values = list(out.args[0])
        del values[len(step.signature.state) - 1]
        out.args = (values,)
        return super().run(step)


def test_dce_broken_variant_is_caught_in_a_pipeline():
    step, _, _ = _dead_step()
    with pytest.raises(VerificationError) as info:
        Pipeline([DeadCodeElimination, _BrokenDce()], verify_level=2).run(step)
    assert info.value.invariant == "INV-3" and info.value.transform == "recir-test-broken-dce"
