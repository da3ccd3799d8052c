"""``compile(step, embedding_backend="cpu")``: tables and their optimizer state on the host (PyTorch), the
rest one jitted JAX program; 20-step parity with ``in_graph`` (every parameter and optimizer-state slot).

The reference model has two ``nn.EmbeddingBag`` tables (sum with per-sample weights; mean) and a dense
MLP, so the device returns the pooled rows' gradients and the host expands them per id.
"""

from __future__ import annotations

import jax
import pytest
import torch
from recir.capture import capture_train_step, testing
from recir.lower_tpu import HostSplitCompiledStep, compile
from recir.transforms import CompiledStep, ConfigError

pytestmark = pytest.mark.tpu

STEPS = 20
# Adam's square roots and divisions on a TPU are not PyTorch's on the host: 2.8e-5 apart after 20 steps
# (measured on a v5e); within 1e-5 on JAX's CPU backend
TOL = 1e-4 if jax.default_backend() == "tpu" else 1e-5


def _captured(opt_name: str):  # type: ignore[no-untyped-def]
    case = testing.REFERENCE_CASES["embedding_bag"]
    model = case.build(seed=0)
    optimizer = testing.make_optimizer(opt_name, model.parameters())
    step = capture_train_step(model, optimizer, case.loss_fn, case.make_batch(0), overrides=case.overrides())
    return case, model, optimizer, step


def _parity(opt_name: str, mesh=None) -> None:  # type: ignore[no-untyped-def]
    case, model, optimizer, step = _captured(opt_name)
    host = compile(step, mesh=mesh, embedding_backend="cpu")
    ref = compile(step, mesh=mesh, embedding_backend="in_graph")
    assert isinstance(host, HostSplitCompiledStep) and isinstance(host, CompiledStep)
    tables = sorted(host.split.tables)
    assert tables == ["param:tables.0.weight", "param:tables.1.weight"], tables
    # the device part holds no table and no table optimizer state
    device_slots = {s.name for s in host.device.step.signature.state}
    assert not device_slots & {s for slots in host.split.tables.values() for s in slots}
    s_host, s_ref = host.init_state(model, optimizer), ref.init_state(model, optimizer)
    table = s_host[step.signature.state_index("param:tables.0.weight")]
    for i in range(STEPS):
        batch = case.make_batch(i)
        s_host, out_host = host(s_host, batch)
        s_ref, out_ref = ref(s_ref, batch)
        torch.testing.assert_close(out_host[0], out_ref[0], rtol=0, atol=TOL)
    # in place: the host table is the same tensor after 20 steps
    assert s_host[step.signature.state_index("param:tables.0.weight")] is table
    got, want = host.state_dict(s_host), ref.state_dict(s_ref)
    assert list(got) == list(want) == step.signature.state_names()
    bad = testing.state_mismatches(got, want, rtol=0, atol=TOL)
    assert not bad, f"after {STEPS} steps these slots differ (max abs error): {bad}"
    assert not torch.equal(got["param:tables.0.weight"], model.tables[0].weight.detach())  # it trained


@pytest.mark.parametrize("opt_name", ["rowwise_adagrad", "adam"])
def test_host_tables_match_in_graph_for_20_steps(opt_name: str) -> None:
    _parity(opt_name)


def test_host_tables_match_in_graph_on_8_host_devices() -> None:
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 JAX devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, as nox -s tpu)")
    from recir.distributed import Mesh

    _parity("rowwise_adagrad", mesh=Mesh(axes={"data": 8}))


def test_host_state_round_trips_through_state_dict() -> None:
    case, model, optimizer, step = _captured("rowwise_adagrad")
    host = compile(step, embedding_backend="cpu")
    state = host.init_state(model, optimizer)
    state, _ = host(state, case.make_batch(0))
    saved = host.state_dict(state)
    again = host.load_state_dict(saved)
    assert not testing.state_mismatches(host.state_dict(again), saved, rtol=0, atol=0)
    with pytest.raises(ConfigError, match="lives on the host"):
        host([jax.numpy.zeros(()) if i in host.split.host_slots else x for i, x in enumerate(again)],
             case.make_batch(1))  # fmt: skip


def test_node_seconds_reads_the_device_part(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from recir.lower_tpu import node_seconds

    case, model, optimizer, step = _captured("rowwise_adagrad")
    host = compile(step, embedding_backend="cpu")
    state, _ = host(host.init_state(model, optimizer), case.make_batch(0))
    with jax.profiler.trace(str(tmp_path)):
        state, outputs = host(state, case.make_batch(1))
        float(outputs[0])
    seconds = node_seconds(host, tmp_path)
    assert set(seconds) & {n.name for n in host.device.step.graph.nodes}, sorted(seconds)[:10]


def test_node_seconds_reads_tpu_event_names() -> None:
    """A TPU trace names each XLA event by its whole instruction (measured on a v5e), a CPU trace by the
    instruction's name: both map to the name the optimised HLO's metadata is read under."""
    from recir.lower_tpu._profile import _instruction

    tpu = "%add_divide_fusion.1 = (f32[8]{0:T(128)S(1)}) fusion(f32[]{:T(128)} %copy.43), kind=kLoop"
    assert _instruction(tpu) == "add_divide_fusion.1"
    assert _instruction("fusion.3") == "fusion.3"
