"""phase_split: forward-only and forward+backward StepGraphs; numerics against autograd, negative cases."""

from __future__ import annotations

import re

import pytest
import torch
from _transforms_stepgraphs import mark_phase, mlp_sgd_step, trace_step
from recir.transforms import PHASE_KEY, ConfigError, phase_split, verify


def _without_detach(text: str) -> str:
    """The graph text with make_fx's detach nodes bypassed (their number varies with the torch release;
    from torch 2.13 they are alias nodes)."""
    alias: dict[str, str] = {}
    lines = []
    for line in text.splitlines():
        m = re.match(r"(%\w+) = aten\.(?:detach|alias)\((%\w+)\)", line)
        if m:
            alias[m[1]] = alias.get(m[2], m[2])
        else:
            lines.append(re.sub(r"%\w+", lambda v: alias.get(v[0], v[0]), line))
    return "\n".join(lines)


def test_phase_split_forward_snapshot():
    def fn(state, batch):
        (w, m), (x,) = state, batch
        w = w.detach().requires_grad_(True)
        loss = (x @ w).sum()
        outputs = [loss.detach()]
        mark_phase("backward")
        (g,) = torch.autograd.grad(loss, [w])
        mark_phase("optimizer")
        return [(w - 0.1 * g).detach(), m + 1], outputs

    state = {"param:w": ("param", torch.randn(4, 2)), "optim:step": ("optim", torch.zeros(()))}
    step, s, b = trace_step(fn, state, {"x": ("dense", torch.randn(3, 4))}, ["loss"])
    fwd = phase_split(step, "forward")
    assert (
        _without_detach(fwd.format_graph())
        == """\
%param_w = input
%x = input
%mm = aten.mm(%x, %param_w)  # forward
%sum_1 = aten.sum(%mm)  # forward
return [%param_w, %sum_1]"""
    )
    assert [s.name for s in fwd.signature.state] == ["param:w"]  # optim:step is not read by forward
    assert fwd.meta["recir.phase_split"] == "forward"
    verify(fwd, level=2)
    new_state, (loss,) = fwd([s[0]], b)
    assert new_state[0] is s[0]  # no state update
    torch.testing.assert_close(loss, (b[0] @ s[0]).sum())
    # the original is untouched
    assert step.phase_counts()["optimizer"] > 0 and len(step.signature.state) == 2


def test_phase_split_backward_returns_gradients():
    step, state, batch = mlp_sgd_step()
    bwd = phase_split(step, "backward")
    names = [o.name for o in bwd.signature.outputs]
    assert names == [
        "loss",
        "pred_sum",
        "grad:param:fc2.weight",
        "grad:param:fc1.bias",
        "grad:param:fc1.weight",
    ]
    assert {n.meta.get(PHASE_KEY) for n in bwd.graph.nodes} == {None, "forward", "backward"}
    assert [s.kind for s in bwd.signature.state] == ["param", "param", "param", "buffer"]
    verify(bwd, level=2)
    _, outs = bwd(state[:4], batch)
    # gradients against eager autograd
    w1, b1, w2 = (t.clone().requires_grad_(True) for t in state[:3])
    x, y = batch
    pred = (torch.relu(x @ w1 + b1) @ w2) * state[3]
    loss = ((pred - y) ** 2).mean()
    loss.backward()
    torch.testing.assert_close(outs[0], loss.detach())
    torch.testing.assert_close(outs[2], w2.grad)
    torch.testing.assert_close(outs[3], b1.grad)
    torch.testing.assert_close(outs[4], w1.grad)


def test_phase_split_negative_cases():
    step, _, _ = mlp_sgd_step()
    with pytest.raises(ConfigError, match="upto must be"):
        phase_split(step, "optimizer")  # type: ignore[arg-type]

    def late_output(state, batch):
        (w,), (x,) = state, batch
        loss = (x @ w).sum()
        mark_phase("optimizer")
        new_w = w * 0.5
        return [new_w], [new_w.sum() + loss]  # a user output computed in the optimizer phase

    step, _, _ = trace_step(
        late_output, {"param:w": ("param", torch.randn(4, 2))}, {"x": ("dense", torch.randn(3, 4))}, ["loss"]
    )
    with pytest.raises(ConfigError, match="a user output needs %.* of phase optimizer"):
        phase_split(step, "forward")
