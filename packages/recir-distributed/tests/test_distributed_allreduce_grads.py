"""recir-dist-allreduce-grads: snapshot, numerics against the untransformed step, negative and broken cases."""

from __future__ import annotations

import re

import pytest
import recir.distributed as rd
import torch
from _distributed_models import MLP_PARAMS, collective_lines, init_state, mlp_batch, mlp_step
from recir.transforms import GRAD_OF_KEY, SHARDING_KEY, Pipeline, TransformResult, VerificationError, verify


def test_allreduce_grads_snapshot():
    step = mlp_step(4)
    plan = rd.plan(step, rd.DataParallel(), rd.Mesh(axes={"data": 2}))
    result = rd.AllReduceGradients(plan=plan, rank=0)(step)
    assert result.changed and result.stats == {"all_reduces": 5}
    verify(result.step, level=2, transform=rd.AllReduceGradients.name)
    lines = collective_lines(result.step).splitlines()
    assert lines[:5] == [
        "%all_reduce_default_4 = _c10d_functional.all_reduce(%t_6, 'avg', '0')  # backward",
        "%wait_tensor_default_4 = _c10d_functional.wait_tensor(%all_reduce_default_4)  # backward",
        "  -> %mul_27 = aten.mul.Tensor(%wait_tensor_default_4, 0.09999999999999998)  # optimizer",
        "  -> %mul_29 = aten.mul.Tensor(%wait_tensor_default_4, 0.010000000000000009)  # optimizer",
        "  -> %mul_30 = aten.mul.Tensor(%mul_29, %wait_tensor_default_4)  # optimizer",
    ]
    # the loss is averaged too, so every rank reports the global loss
    # (the loss reaches it through make_fx's detach nodes, whose number varies with the torch release)
    assert re.match(
        r"%all_reduce_default_5 = _c10d_functional\.all_reduce\(%detach(_\d+)?, 'avg', '0'\)", lines[-3]
    )
    wait = next(n for n in result.step.graph.nodes if n.name == "wait_tensor_default_4")
    assert wait.meta[SHARDING_KEY]["role"] == "gradient" and wait.meta["val"].shape == (1, 4)
    # the input step is left untouched
    assert "all_reduce" not in step.format_graph()


def test_allreduce_grads_numerics_on_one_process(world1):
    step = mlp_step(4)
    plan = rd.plan(step, rd.DataParallel(), rd.Mesh(axes={"data": 1}))
    dstep = rd.AllReduceGradients(plan=plan, rank=0)(step).step
    state = step.load_state_dict(init_state(MLP_PARAMS))
    ref, got = list(state), list(state)
    for k in range(3):
        ref, ref_out = step(ref, mlp_batch(4, k))
        got, got_out = dstep(got, mlp_batch(4, k))
    for slot, a, b in zip(step.signature.state, ref, got):
        assert torch.equal(a, b), slot.name
    assert torch.equal(ref_out[0], got_out[0])


def test_allreduce_grads_needs_gradient_markers():
    step = mlp_step(4)
    plan = rd.plan(step, rd.DataParallel(), rd.Mesh(axes={"data": 2}))
    for node in step.graph.nodes:
        node.meta.pop(GRAD_OF_KEY, None)
    with pytest.raises(rd.ConfigError, match=r"no node carries 'recir.grad_of' for \['param:fc1.weight'"):
        rd.AllReduceGradients(plan=plan)(step)
    other = rd.plan(mlp_step(4), rd.DataParallel(), rd.Mesh(axes={"data": 2}))
    other.slots.pop("optim:step")
    with pytest.raises(rd.ConfigError, match="no placement for state slots"):
        rd.AllReduceGradients(plan=other)(mlp_step(4))


class _InPlaceAllReduce(rd.AllReduceGradients):
    """Deliberately broken: uses the mutating c10d all_reduce_ instead of the functional one."""

    def run(self, step):  # noqa: ANN001, ANN201
        result = super().run(step)
        for node in result.step.graph.nodes:
            if node.target is torch.ops._c10d_functional.all_reduce.default:
                node.target = torch.ops._c10d_functional.all_reduce_.default
        return TransformResult(result.step, True, result.stats)


def test_broken_allreduce_is_caught_by_the_verifier():
    step = mlp_step(4)
    plan = rd.plan(step, rd.DataParallel(), rd.Mesh(axes={"data": 2}))
    with pytest.raises(VerificationError, match="INV-2") as info:
        Pipeline([_InPlaceAllReduce(plan=plan)], verify_level=2).run(step)
    assert info.value.transform == "recir-dist-allreduce-grads"
