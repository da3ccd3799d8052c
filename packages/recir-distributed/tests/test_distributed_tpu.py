"""The TPU path: a plan becomes NamedShardings for state and batch (recir.lower_tpu's PlannedPlacement) and
GSPMD partitions the global step. 8 JAX host devices (``nox -s tpu`` sets
XLA_FLAGS=--xla_force_host_platform_device_count=8 and JAX_PLATFORMS=cpu).
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import _distributed_models as M  # noqa: E402
import recir.distributed as rd  # noqa: E402

pytestmark = [
    pytest.mark.tpu,
    pytest.mark.skipif(
        jax.device_count() < 8,
        reason=f"needs 8 JAX devices, found {jax.device_count()} (run with JAX_PLATFORMS=cpu "
        "XLA_FLAGS=--xla_force_host_platform_device_count=8, as `nox -s tpu` does)",
    ),
]

CASES = [
    # kind, mode, mesh, collectives the compiled HLO must contain
    ("mlp", "data_parallel", {"data": 8}, ["all-reduce"]),
    ("mlp", "fsdp", {"data": 8}, ["all-gather", "all-reduce"]),
    ("emb", "row_wise", {"data": 2, "model": 4}, ["all-reduce"]),
]


@pytest.mark.parametrize(("kind", "mode", "axes", "expected"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_gspmd_partitions_the_planned_step(kind, mode, axes, expected):
    from recir.lower_tpu import TPUCompiledStep, TPUOptions
    from recir.lower_tpu._sharding import placement_for

    step = M.mlp_step(16) if kind == "mlp" else M.emb_step(16)
    params, make_batch = (M.MLP_PARAMS, M.mlp_batch) if kind == "mlp" else (M.EMB_PARAMS, M.emb_batch)
    plan = rd.plan(step, mode, rd.Mesh(axes=axes), batch="global")
    compiled = TPUCompiledStep(step, placement_for(plan.mesh, plan), TPUOptions(), None)
    hlo = compiled.lower().compile().as_text()
    for name in expected:
        assert name in hlo, f"{kind}/{mode}: no {name} in the compiled HLO"
    if mode == "data_parallel":
        assert "all-gather" not in hlo  # replicated params are never gathered
    full = M.init_state(params)
    ref, got = step.load_state_dict(full), compiled.load_state_dict(full)
    first = got[0]
    table_axis = "model" if "model" in axes else "data"
    want_spec = {"data_parallel": (), "fsdp": ("data",), "row_wise": (table_axis,)}[mode]
    assert tuple(first.sharding.spec) == want_spec
    for k in range(2):
        ref, ref_out = step(ref, make_batch(16, k))
        got, got_out = compiled(got, make_batch(16, k))
    got_sd = compiled.state_dict(got)
    for slot, want in zip(step.signature.state, ref):
        assert (got_sd[slot.name] - want).abs().max().item() < 1e-5, slot.name
    assert abs(float(ref_out[0]) - float(got_out[0])) < 1e-5
