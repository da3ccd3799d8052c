"""recir-mixed-precision: snapshot, numerics (params and optimizer state stay fp32, close to fp32 maths),
one cast per value, optimizer untouched, bad options, and a broken variant the verifier catches."""

from __future__ import annotations

import pytest
import torch
from _transforms_stepgraphs import mark_phase, mlp_sgd_step, run_steps, trace_step
from recir.transforms import (
    ConfigError,
    MixedPrecision,
    Pipeline,
    VerificationError,
    parse_pipeline,
    verify,
)

_aten = torch.ops.aten


def _gram_step():
    """A forward mm feeding a loss and a buffer (a running Gram matrix) updated in the forward phase."""

    def fn(state, batch):
        (w, _gram), (x,) = state, batch
        loss = (x @ w).sum()
        new_gram = x.t() @ x
        mark_phase("optimizer")
        return [w * 0.5, new_gram], [loss]

    return trace_step(
        fn,
        {"param:w": ("param", torch.randn(4, 2)), "buffer:gram": ("buffer", torch.zeros(4, 4))},
        {"x": ("dense", torch.randn(3, 4))},
        ["loss"],
    )


def test_mixed_precision_snapshot():
    step, _, _ = _gram_step()
    result = MixedPrecision().run(step)
    assert result.changed
    # x is cast once for both products: t(x) becomes t(x_bf16)
    assert result.stats == {"matmuls": 2, "mm": 2, "casts": 2}
    assert (
        step.format_graph()
        == """\
%param_w = input
%buffer_gram = input
%x = input
%x_bf16 = aten._to_copy(%x, dtype=torch.bfloat16)  # forward
%param_w_bf16 = aten._to_copy(%param_w, dtype=torch.bfloat16)  # forward
%mm = aten.mm(%x_bf16, %param_w_bf16)  # forward
%mm_f32 = aten._to_copy(%mm, dtype=torch.float32)  # forward
%sum_1 = aten.sum(%mm_f32)  # forward
%t_bf16 = aten.t(%x_bf16)  # forward
%mm_1 = aten.mm(%t_bf16, %x_bf16)  # forward
%mm_1_f32 = aten._to_copy(%mm_1, dtype=torch.float32)  # forward
%mul = aten.mul.Tensor(%param_w, 0.5)  # optimizer
return [%mul, %mm_1_f32, %sum_1]"""
    )
    verify(step, level=2)


def test_mixed_precision_numerics_keep_fp32_master_state():
    step, s, b = mlp_sgd_step(din=16, hidden=32, dout=4, batch=8)
    ref, _, _ = mlp_sgd_step(din=16, hidden=32, dout=4, batch=8)
    pipe = parse_pipeline("recir-mixed-precision")
    out = pipe.run(step)
    # forward: x@w1 (addmm after decomposition or mm + add) and h@w2; backward: their input/weight grads
    assert pipe.records[0].stats["matmuls"] >= 4
    low = [n for n in out.graph.nodes if n.target in (_aten.mm.default, _aten.addmm.default)]
    assert low and all(n.meta["val"].dtype == torch.bfloat16 for n in low)
    assert all(
        n.meta["recir.phase"] != "optimizer" for n in out.graph.nodes if n.target == _aten._to_copy.default
    )
    a_state, a_out = run_steps(out, s, b, n=1)
    r_state, r_out = run_steps(ref, s, b, n=1)
    errors = {}
    for slot, x, y in zip(out.signature.state, a_state, r_state):  # parameters and momentum buffers
        assert x.dtype == torch.float32, slot.name
        errors[slot.name] = ((x - y).abs().max() / y.abs().max()).item()
    # bf16 has an 8-bit mantissa: relative errors of a few 1e-3, never 0 where a product was involved
    assert all(e < 2e-2 for e in errors.values()), errors
    assert errors["param:fc1.weight"] > 0 and errors["optim:fc2.weight:momentum_buffer"] > 0, errors
    assert errors["buffer:scale"] == 0
    torch.testing.assert_close(a_out[0], r_out[0], rtol=2e-2, atol=0)


def test_mixed_precision_float16_and_bfloat16_inputs_left_alone():
    def fn(state, batch):
        (w,), (x,) = state, batch
        loss = (x @ w.to(torch.bfloat16)).float().sum()  # already low precision: nothing to do
        mark_phase("optimizer")
        return [w * 0.5], [loss]

    step, _, _ = trace_step(
        fn,
        {"param:w": ("param", torch.randn(4, 2))},
        {"x": ("dense", torch.randn(3, 4).bfloat16())},
        ["loss"],
    )
    assert not MixedPrecision().run(step).changed
    step, _, _ = _gram_step()
    assert MixedPrecision(compute_dtype="float16").run(step).changed
    assert "dtype=torch.float16" in step.format_graph()


def test_mixed_precision_negative_options():
    step, _, _ = _gram_step()
    with pytest.raises(ConfigError, match="compute_dtype='int8'"):
        MixedPrecision(compute_dtype="int8").run(step)
    with pytest.raises(ConfigError, match="master weights"):
        MixedPrecision(phases=("forward", "optimizer")).run(step)
    # only backward: the forward products stay fp32
    assert not MixedPrecision(phases=("backward",)).run(step).changed
    with pytest.raises(ConfigError, match="names matmul"):
        MixedPrecision(ops=("mm", "matmul")).run(step)
    assert not MixedPrecision(ops=("bmm",)).run(step).changed  # the step has mm products only
    assert MixedPrecision(ops=("mm",)).run(step).stats["mm"] == 2
    assert (
        str(Pipeline([MixedPrecision(compute_dtype="float16")]))
        == "recir-mixed-precision{compute_dtype=float16}"
    )


class _NoCastBack(MixedPrecision):
    """Deliberately broken: leaves each product in bf16 (no cast back to fp32)."""

    name = "recir-test-broken-mixed-precision"

    def run(self, step):
        result = super().run(step)
        for node in list(step.graph.nodes):
            if node.target == _aten._to_copy.default and node.kwargs.get("dtype") == torch.float32:
                node.replace_all_uses_with(node.args[0])
                step.graph.erase_node(node)
        step.graph_module.recompile()
        return result


def test_mixed_precision_broken_variant_is_caught():
    step, _, _ = _gram_step()
    with pytest.raises(VerificationError) as info:
        Pipeline([_NoCastBack()], verify_level=2).run(step)
    assert info.value.invariant == "INV-4" and info.value.transform == "recir-test-broken-mixed-precision"
