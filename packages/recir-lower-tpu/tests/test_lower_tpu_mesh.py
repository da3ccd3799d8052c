"""compile(step, mesh=...) on 8 JAX devices: state and batch replicated over the mesh (sharding plans
come later), same numbers as one device, state still donated. Needs 8 devices: a TPU slice, or the
``tpu`` nox session's XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU."""

from __future__ import annotations

import jax
import pytest
import torch
from jax.sharding import Mesh, NamedSharding
from recir.capture import capture_train_step, testing
from recir.lower_tpu import compile
from recir.transforms import ConfigError

pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(
        jax.device_count() < 8,
        reason=f"needs 8 JAX devices, found {jax.device_count()} "
        "(run `nox -s tpu`, which sets XLA_FLAGS=--xla_force_host_platform_device_count=8)",
    ),
]


class _Axes:
    """Stands in for recir.distributed.Mesh: anything with ``axes`` {name: size}."""

    def __init__(self, **axes: int):
        self.axes = axes


def _captured(opt_name: str = "adam"):
    case = testing.REFERENCE_CASES["mlp"]
    model = case.build(seed=0)
    optimizer = testing.make_optimizer(opt_name, model.parameters())
    step = capture_train_step(model, optimizer, case.loss_fn, case.make_batch(0))
    return case, model, optimizer, step


@pytest.mark.parametrize("mesh_kind", ["axes", "jax"])
def test_replicated_mesh_matches_one_device(mesh_kind):
    case, model, optimizer, step = _captured()
    mesh = _Axes(data=8) if mesh_kind == "axes" else Mesh(jax.devices()[:8], ("data",))
    on_mesh = compile(step, mesh=mesh)
    single = compile(step)
    a = on_mesh.init_state(model, optimizer)
    b = single.init_state(model, optimizer)
    assert isinstance(a[0].sharding, NamedSharding) and len(a[0].sharding.device_set) == 8
    assert len(b[0].sharding.device_set) == 1
    for i in range(3):
        old = a
        a, (loss_a, *_) = on_mesh(a, case.make_batch(i))
        b, (loss_b, *_) = single(b, case.make_batch(i))
        assert all(x.is_deleted() for x in old)
        torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-6)
    assert len(a[0].sharding.device_set) == 8, "new state stays on the mesh"
    got, want = on_mesh.state_dict(a), single.state_dict(b)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, msg=name)


def test_mesh_of_the_wrong_size_is_a_config_error():
    _, _, _, step = _captured("sgd")
    with pytest.raises(ConfigError, match="needs 16 devices"):
        compile(step, mesh=_Axes(data=2, model=8))
    with pytest.raises(
        ConfigError, match="recir.lower_tpu.compile: plan must be a recir.distributed.ShardingPlan"
    ):
        compile(step, {"slots": {}})  # a plan's dict form is not a plan: ShardingPlan.from_dict it


def test_compile_with_a_sharding_plan_shards_state_and_matches_one_device():
    import recir.distributed as rd

    case, model, optimizer, step = _captured()
    plan = rd.plan(step, "fsdp", rd.Mesh(axes={"data": 4, "model": 2}), batch="global")  # batch of 4
    sharded = compile(step, plan)  # the mesh comes from the plan
    single = compile(step)
    a = sharded.init_state(model, optimizer)
    b = single.init_state(model, optimizer)
    assert any(tuple(x.sharding.spec) == ("data",) for x in a), "FSDP shards some state over 'data'"
    # The planner's recir.sharding on gradient nodes becomes GSPMD sharding constraints in the program.
    annotated = [n for n in step.graph.nodes if sharded.placement.node_sharding(n) is not None]
    assert annotated, "an FSDP plan shards some gradient"
    text = sharded.lower().as_text()
    constraints = text.count("sdy.sharding_constraint") + text.count("@Sharding")
    assert constraints >= len(annotated), (constraints, len(annotated))
    assert single.lower().as_text().count("sdy.sharding_constraint") == 0
    for i in range(3):
        a, (loss_a, *_) = sharded(a, case.make_batch(i))
        b, (loss_b, *_) = single(b, case.make_batch(i))
        torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    got, want = sharded.state_dict(a), single.state_dict(b)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
