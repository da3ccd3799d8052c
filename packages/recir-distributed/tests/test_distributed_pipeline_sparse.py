"""recir-pipeline-sparse on distributed steps: batch i+1's ids travel (all-to-all) during batch i's step.
2 gloo ranks (the GPU path's per-device programs, interpreter and recir.lower_gpu) and 8 JAX host devices
(the TPU path's GSPMD-partitioned global step)."""

from __future__ import annotations

import pytest
import torch
from _distributed_workers import pipelined_matches_unpipelined, spawn


def test_pipelined_steps_train_like_unpipelined_ones_on_two_gloo_ranks():
    pytest.importorskip("recir.lower_gpu")
    cases = [("row_wise", 2, False), ("table_wise", 3, False), ("row_wise", 2, True), ("row_wise", 3, True)]
    spawn(pipelined_matches_unpipelined, 2, cases)


def test_the_ids_all_to_all_moves_ahead_and_its_wait_comes_last():
    import _distributed_models as M
    import recir.distributed as rd
    from recir.transforms import PIPELINE_SPARSE_KEY, PipelineSparse

    step = M.emb_step(4)
    plan = rd.plan(step, "row_wise", rd.Mesh(axes={"data": 2}))
    dstep = rd.distribute(step, plan, 0)
    result = PipelineSparse(stages=2)(dstep)
    steady = result.step
    # ids and offsets of both tables go out ahead (4 all-to-alls); the pooled rows and the gradients stay
    assert result.stats["collectives"] == 4
    a2a = torch.ops._c10d_functional.all_to_all_single.default
    wait = torch.ops._c10d_functional.wait_tensor.default
    nodes = list(steady.graph.nodes)
    moved = set(steady.meta[PIPELINE_SPARSE_KEY].moved)
    ahead = [n for n in nodes if n.target is a2a and n.name in moved]
    assert len(ahead) == 4 and all(n.meta["recir.sharding"]["role"] in ("ids", "offsets") for n in ahead)
    waits = [next(iter(n.users)) for n in ahead]
    assert all(w.target is wait for w in waits)
    last_compute = max(i for i, n in enumerate(nodes) if n.meta.get("recir.phase") == "optimizer")
    assert all(nodes.index(w) > last_compute for w in waits)  # waited for after the optimizer: overlap
    lookups = [n for n in nodes if n.target is torch.ops.recir.embedding_bag.default]

    def carried(a: torch.fx.Node) -> bool:  # a carry, or a view of one (slices per source device)
        return a.name.startswith("carry_0_") or any(carried(i) for i in a.all_input_nodes)

    assert lookups and all(carried(n.args[1]) for n in lookups)  # batch i's ids arrived during step i-1


jax = pytest.importorskip("jax")


@pytest.mark.tpu
@pytest.mark.skipif(
    jax.device_count() < 8,
    reason=f"needs 8 JAX devices, found {jax.device_count()} (run with JAX_PLATFORMS=cpu "
    "XLA_FLAGS=--xla_force_host_platform_device_count=8, as `nox -s tpu` does)",
)
@pytest.mark.parametrize("stages", [2, 3])
def test_pipelined_step_on_eight_host_devices_trains_like_the_unpipelined_one(stages):
    import _distributed_models as M
    import recir.distributed as rd
    from recir.lower_tpu import compile as lower_tpu
    from recir.transforms import PipelinedStep

    step = M.emb_step(16, hashed=True)
    plan = rd.plan(step, "row_wise", rd.Mesh(axes={"data": 2, "model": 4}), batch="global")
    pipe = PipelinedStep.build(step, stages=stages, compile=lambda s: lower_tpu(s, plan, mesh=plan.mesh))
    ref_step = lower_tpu(step, plan, mesh=plan.mesh)
    full = M.init_state(M.EMB_PARAMS)
    batches = [M.emb_batch(16, k) for k in range(5)]
    ref, ref_losses = ref_step.load_state_dict(full), []
    for batch in batches:
        ref, out = ref_step(ref, batch)
        ref_losses.append(float(out[0]))
    ran = list(pipe.run(pipe.load_state_dict(full), batches))
    state, losses = ran[-1][0], [float(out[0]) for _, out in ran]
    got, want = pipe.state_dict(state), ref_step.state_dict(ref)
    for name, value in want.items():  # parameters and Adam moments
        assert (got[name] - value).abs().max().item() <= 1e-6, name
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-6
    assert any(name.startswith("carry:") for name in got)
