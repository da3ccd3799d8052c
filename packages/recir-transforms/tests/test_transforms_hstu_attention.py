"""``recir::hstu_attention`` (and its backward op) and ``recir-override-inline-references``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from recir.transforms import (
    OVERRIDE_KEY,
    ConfigError,
    InlineReferences,
    StepGraph,
    hstu_attention,
    hstu_attention_reference,
    override_for_op,
    verify,
)
from torch.fx.experimental.proxy_tensor import make_fx

_OP = torch.ops.recir.hstu_attention.default
_BWD = torch.ops.recir.hstu_attention_backward.default
B, H, N, A, PREFIX, ALPHA = 3, 2, 11, 8, 8, 0.3


def _inputs(dtype=torch.float64):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, N, H, A, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(3))
    history, candidates = torch.tensor([8, 3, 0]), torch.tensor([3, 1, 2])  # full, padded, empty history
    valid = torch.cat(
        [torch.arange(PREFIX)[None] < history[:, None], torch.arange(N - PREFIX)[None] < candidates[:, None]],
        1,
    )
    return q, k, v, valid, torch.tensor(9.0, dtype=dtype)


def _dense(q, k, v, valid, scale):
    """The mask written out: i sees j iff both valid and (j < prefix and j < i, or j == i)."""
    i, j = torch.arange(N)[:, None], torch.arange(N)[None]
    mask = (((j < PREFIX) & (j < i)) | (i == j))[None] & valid[:, :, None] & valid[:, None, :]
    return (F.silu(ALPHA * q @ k.transpose(-1, -2)) / scale * mask[:, None]) @ v


@pytest.mark.parametrize("bounds", [[0, N], [0, 5, N], [0, 3, 8, 9, N]])
def test_hstu_attention_equals_the_dense_mask_with_gradients(bounds):
    q, k, v, valid, scale = _inputs()
    out = hstu_attention(q, k, v, valid, scale, PREFIX, ALPHA, bounds)
    want = _dense(q, k, v, valid, scale)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert out.is_contiguous()
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    for name, g, w in zip("qkv", got, torch.autograd.grad(want, (q, k, v), grad), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=name)


def test_hstu_attention_saves_q_k_v_not_the_scores():
    q, k, v, valid, scale = _inputs()
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        hstu_attention(q, k, v, valid, scale, PREFIX, ALPHA, [0, N])
    assert saved and all(s.numel() <= B * H * N * A for s in saved)


def test_hstu_attention_traces_as_two_opaque_nodes():
    q, k, v, valid, scale = _inputs(torch.float32)

    def step(q, k, v, valid, scale):
        out = hstu_attention(q, k, v, valid, scale, PREFIX, ALPHA, [0, 5, N])
        return torch.autograd.grad(out.sum(), (q, k, v))

    gm = make_fx(step)(q, k, v, valid, scale)
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(_OP) == 1 and targets.count(_BWD) == 1
    assert not any(t is torch.ops.aten.bmm.default for t in targets)  # the scores stay inside the ops


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(prefix=0), "prefix must be in"),
        (dict(bounds=[0, 4, 4, N]), "bounds must rise strictly"),
        (dict(valid=torch.ones(B, N - 1, dtype=torch.bool)), "valid must be bool"),
    ],
)
def test_hstu_attention_bad_arguments(change, message):
    q, k, v, valid, scale = _inputs()
    args = dict(valid=valid, prefix=PREFIX, bounds=[0, N]) | change
    with pytest.raises(ValueError, match=message):
        hstu_attention(q, k, v, args["valid"], scale, args["prefix"], ALPHA, args["bounds"])


def _attention_step() -> tuple[StepGraph, list[torch.Tensor], list[torch.Tensor]]:
    """A tiny captured SGD step whose forward and backward are the two attention ops (q, k, v as state)."""
    from _transforms_stepgraphs import mark_phase, trace_step

    q, k, v, valid, scale = (
        t.detach().float().contiguous() if t.is_floating_point() else t for t in _inputs()
    )

    def fn(state, batch):
        q, k, v = (t.detach().requires_grad_(True) for t in state)
        valid, scale = batch
        out = hstu_attention(q, k, v, valid, scale, PREFIX, ALPHA, [0, 5, N])
        loss = out.square().sum()
        mark_phase("backward")
        grads = torch.autograd.grad(loss, (q, k, v))
        mark_phase("optimizer")
        return [(t - 0.01 * g).detach() for t, g in zip((q, k, v), grads)], [loss.detach()]

    state = {f"param:{n}": ("param", t) for n, t in zip("qkv", (q, k, v))}
    traced = trace_step(fn, state, {"valid": ("other", valid), "scale": ("dense", scale)}, ["loss"])
    for node in traced[0].graph.nodes:  # what capture marks on override ops
        if node.target in (_OP, _BWD):
            node.meta[OVERRIDE_KEY] = override_for_op(node.target)
    return traced


def test_inline_references_gives_the_ops_values_in_aten():
    from _transforms_stepgraphs import run_steps

    step, state, batch = _attention_step()
    verify(step)
    assert [n.target for n in step.graph.nodes].count(_BWD) == 1
    before = run_steps(step, state, batch)
    result = InlineReferences(ops=("recir::hstu_attention", "recir::hstu_attention_backward")).run(
        step.copy()
    )
    assert result.changed and result.stats["inlined"] == 2
    targets = {n.target for n in result.step.graph.nodes}
    assert _OP not in targets and _BWD not in targets and torch.ops.aten.bmm.default in targets
    verify(result.step)
    after = run_steps(result.step, state, batch)
    for got, want in zip([*after[0], *after[1]], [*before[0], *before[1]], strict=True):  # params and loss
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # only the named ops: the backward left alone stays one node
    only_fwd = InlineReferences(ops=("recir::hstu_attention",)).run(step.copy()).step
    assert [n.target for n in only_fwd.graph.nodes].count(_BWD) == 1
    assert not InlineReferences(ops=("recir::embedding_bag",)).run(step.copy()).changed


def test_inline_references_refuses_an_op_without_a_reference():
    step = _attention_step()[0]
    for node in step.graph.nodes:
        if node.target is _OP:
            node.target = torch.ops.recir.recompute_barrier.default  # defined without a *_reference
            node.args = ([node.args[0]],)
    with pytest.raises(ConfigError, match="recir::recompute_barrier has no pure-ATen reference"):
        InlineReferences(ops=("recir::recompute_barrier",)).run(step)


def test_reference_is_what_the_op_runs():
    q, k, v, valid, scale = _inputs()
    args = (q, k, v, valid, scale, PREFIX, ALPHA, [0, 6, N])
    torch.testing.assert_close(hstu_attention(*args), hstu_attention_reference(*args), rtol=0, atol=0)


def test_mixed_precision_runs_the_attention_ops_low():
    # recir-mixed-precision: both ops read bf16 q, k, v (and gradient); their results come back fp32, so the
    # optimizer still updates fp32 state; values near fp32's
    from _transforms_stepgraphs import run_steps
    from recir.transforms import MixedPrecision

    step, state, batch = _attention_step()
    result = MixedPrecision(compute_dtype="bfloat16").run(step.copy())
    assert result.stats["hstu_attention"] == 1 and result.stats["hstu_attention_backward"] == 1
    verify(result.step)
    for node in result.step.graph.nodes:
        if node.target in (_OP, _BWD):
            tensors = node.args[:4] if node.target is _BWD else node.args[:3]
            assert all(a.meta["val"].dtype == torch.bfloat16 for a in tensors)
            readers = [r for u in node.users for r in u.users] if node.target is _BWD else list(node.users)
            assert all(r.target is torch.ops.aten._to_copy.default for r in readers)
    want, got = run_steps(step, state, batch), run_steps(result.step, state, batch)
    for g, w in zip([*got[0], *got[1]], [*want[0], *want[1]], strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
