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


def _cat_step(also_sum: bool):
    """out = cat([silu(x @ w1), x @ w1, x]) @ w2 (the STU's concat[u, attn, y] before its output product);
    `also_sum`: a loss also reads the concatenation itself."""

    def fn(state, batch):
        (w1, w2), (x,) = state, batch
        h = x @ w1
        cat = torch.cat([torch.nn.functional.silu(h), h, x], dim=-1)
        loss = (cat @ w2).sum() + (cat.sum() if also_sum else 0.0)
        mark_phase("optimizer")
        return [w1 * 0.5, w2 * 0.5], [loss]

    return trace_step(
        fn,
        {"param:w1": ("param", torch.randn(4, 4)), "param:w2": ("param", torch.randn(12, 3))},
        {"x": ("dense", torch.randn(5, 4))},
        ["loss"],
    )


def _products(step, target):
    return [n for n in step.graph.nodes if n.target is target]


def test_mixed_precision_casts_a_concatenation_by_its_parts():
    step, s, b = _cat_step(also_sum=False)
    assert MixedPrecision().run(step).changed
    (cat,) = _products(step, _aten.cat.default)
    # the parts are cast, not the concatenation: its producers write bf16 straight into it
    assert cat.meta["val"].dtype == torch.bfloat16
    h_low = _products(step, _aten.mm.default)[0]
    # x @ w1's bf16 result is the part itself (bf16 -> fp32 -> bf16 is exact): no cast of its fp32 copy
    assert h_low in cat.args[0] and h_low.meta["val"].dtype == torch.bfloat16
    (out,) = [n for n in _products(step, _aten.mm.default) if n.args[0] is cat]
    verify(step, level=2)
    # exactly the values of casting the fp32 concatenation (cat commutes with a cast)
    ref, _, _ = _cat_step(also_sum=False)
    for node in list(ref.graph.nodes):  # the reference: the products on casts of their fp32 operands
        if node.target is _aten.mm.default:
            with ref.graph.inserting_before(node):
                low = [
                    ref.graph.call_function(_aten._to_copy.default, (a,), {"dtype": torch.bfloat16})
                    for a in node.args
                ]
                new = ref.graph.call_function(_aten.mm.default, tuple(low))
            with ref.graph.inserting_after(new):
                back = ref.graph.call_function(_aten._to_copy.default, (new,), {"dtype": torch.float32})
            node.replace_all_uses_with(back)
            ref.graph.erase_node(node)
    ref.graph_module.recompile()
    got_state, got_out = run_steps(step, s, b, n=1)
    want_state, want_out = run_steps(ref, s, b, n=1)
    assert torch.equal(got_out[0], want_out[0])
    assert all(torch.equal(x, y) for x, y in zip(got_state, want_state))


def test_mixed_precision_casts_a_concatenation_other_ops_read_whole():
    step, _, _ = _cat_step(also_sum=True)
    assert MixedPrecision().run(step).changed
    (cat,) = _products(step, _aten.cat.default)
    assert cat.meta["val"].dtype == torch.float32  # the loss reads it in fp32: one fp32 concatenation
    casts = [n for n in step.graph.nodes if n.target is _aten._to_copy.default and n.args[0] is cat]
    assert len(casts) == 1 and casts[0].kwargs["dtype"] == torch.bfloat16
    verify(step, level=2)
