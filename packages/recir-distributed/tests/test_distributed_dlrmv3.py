"""The reference model: DLRMv3 captured with recir.embedding's overrides distributes in every mode
(graph level, both ranks: per-device shapes, collectives, the verifier at RECIR_VERIFY=2)."""

from __future__ import annotations

import pytest
import recir.distributed as rd


@pytest.fixture(scope="module")
def dlrmv3_step():
    import recir.dlrmv3 as D
    from recir.capture import capture_train_step
    from recir.embedding import overrides

    cfg = D.ModelConfig()
    data = D.make_data("debug", cfg, batch_size=8, seed=0)
    model = D.DLRMv3(data.spec, cfg)
    (opt,) = D.make_optimizers(model, 1e-3, 1e-2, "adam", "gpu")
    return capture_train_step(model, opt, D.loss_fn, data.train_batch(0), overrides=overrides())


def test_dlrmv3_distributes_in_every_mode(dlrmv3_step):
    step = dlrmv3_step
    mesh = rd.Mesh(axes={"data": 2})
    seen = {}
    for mode in ["data_parallel", "fsdp", "table_wise", "row_wise"]:
        plan = rd.plan(step, mode, mesh)
        for rank in range(2):
            dstep = rd.distribute(step, plan, rank)
            for slot in dstep.signature.state:
                assert slot.shape == plan.local_shape(slot.name, rank), (mode, slot.name)
        seen[mode] = rd.communication_bytes(dstep)
    assert set(seen["data_parallel"]) == {"all_reduce"}
    assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= set(seen["fsdp"])
    assert "all_to_all_single" in seen["table_wise"] and "all_to_all_single" in seen["row_wise"]
    # the sparse features' tables are sharded; small aten-looked-up tables stay dense parameters
    plan = rd.plan(step, "row_wise", mesh)
    assert plan.tables and all(plan.slots[t]["scheme"] == "row_wise" for t in plan.tables)
