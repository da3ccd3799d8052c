"""recir-dist-shard-params (FSDP): snapshot, numerics against the untransformed step, negative and broken cases."""

from __future__ import annotations

import pytest
import recir.distributed as rd
import torch
from _distributed_models import (
    MLP_PARAMS,
    collective_lines,
    init_state,
    mark_phase,
    mlp_batch,
    mlp_step,
    trace,
)
from recir.transforms import Pipeline, TransformResult, VerificationError, verify


def test_shard_params_snapshot():
    step = mlp_step(4)
    plan = rd.plan(step, rd.FullyShardedDataParallel(), rd.Mesh(axes={"data": 2}))
    result = rd.ShardParameters(plan=plan, rank=1)(step)
    assert result.changed and result.stats == {"sharded_params": 4, "sharded_slots": 12}
    out = result.step
    verify(out, level=2, transform=rd.ShardParameters.name)
    sig = {s.name: s.shape for s in out.signature.state}
    assert sig["param:fc1.weight"] == (4, 4) and sig["optim:fc1.weight:exp_avg"] == (4, 4)
    assert sig["param:head.weight"] == (1, 4) and sig["optim:step"] == ()  # replicated
    lines = collective_lines(out).splitlines()
    assert lines[:3] == [
        "%all_gather_into_tensor_default = _c10d_functional.all_gather_into_tensor(%param_fc1_weight, 2, '0')"
        "  # forward",
        "%wait_tensor_default = _c10d_functional.wait_tensor(%all_gather_into_tensor_default)  # forward",
        "  -> %detach = aten.detach(%wait_tensor_default)  # forward",
    ]
    assert lines[12:15] == [
        "%reduce_scatter_tensor_default_3 = _c10d_functional.reduce_scatter_tensor(%view, 'avg', 2, '0')  # backward",
        "%wait_tensor_default_7 = _c10d_functional.wait_tensor(%reduce_scatter_tensor_default_3)  # backward",
        "  -> %mul_21 = aten.mul.Tensor(%wait_tensor_default_7, 0.09999999999999998)  # optimizer",
    ]
    # the optimizer updates the [4, 4] shard
    new_w = next(n for n in out.graph.nodes if n.op == "output").args[0][0]
    assert new_w.meta["val"].shape == (4, 4)


def test_shard_params_numerics_on_one_process(world1):
    step = mlp_step(4)
    plan = rd.plan(step, rd.FullyShardedDataParallel(), rd.Mesh(axes={"data": 1}))
    dstep = rd.distribute(step, plan, 0)
    assert any("reduce_scatter" in line for line in collective_lines(dstep).splitlines())
    ref = got = step.load_state_dict(init_state(MLP_PARAMS))
    for k in range(3):
        ref, ref_out = step(ref, mlp_batch(4, k))
        got, got_out = dstep(got, mlp_batch(4, k))
    for slot, a, b in zip(step.signature.state, ref, got):
        assert torch.allclose(a, b, atol=1e-6), slot.name
    assert torch.allclose(ref_out[0], got_out[0])


def _clipped(state, batch):  # noqa: ANN001, ANN202
    (w,) = state
    (x,) = batch
    w = w.detach().requires_grad_(True)
    loss = (x @ w).pow(2).mean()
    mark_phase("backward")
    (raw,) = torch.autograd.grad(loss, [w])
    mark_phase("optimizer")
    g = raw / raw.norm().clamp(min=1.0)  # gradient clipping: a global norm over the whole parameter
    return [(w - 0.1 * g).detach()], [loss.detach()], [raw]


def test_shard_params_refuses_reductions_over_shards():
    step = trace(
        _clipped, {"param:w": ("param", torch.randn(4, 2))}, {"x": ("dense", torch.randn(3, 4))}, 1, ["loss"]
    )
    plan = rd.plan(step, rd.FullyShardedDataParallel(), rd.Mesh(axes={"data": 2}))
    with pytest.raises(rd.ConfigError, match=r"reduces over a sharded tensor.*gradient clipping"):
        rd.ShardParameters(plan=plan, rank=0)(step)


class _ForgetsSignature(rd.ShardParameters):
    """Deliberately broken: shards the graph but keeps the global slot shapes in the signature."""

    def run(self, step):  # noqa: ANN001, ANN201
        result = super().run(step)
        return TransformResult(result.step.replace(signature=step.signature), True, result.stats)


def test_broken_shard_params_is_caught_by_the_verifier():
    step = mlp_step(4)
    plan = rd.plan(step, rd.FullyShardedDataParallel(), rd.Mesh(axes={"data": 2}))
    with pytest.raises(VerificationError, match="INV-3") as info:
        Pipeline([_ForgetsSignature(plan=plan)], verify_level=2).run(step)
    assert "param:fc1.weight" in str(info.value)
