"""recir-dist-shard-tables: snapshot, numerics against the untransformed step, negative and broken cases."""

from __future__ import annotations

import pytest
import recir.distributed as rd
import torch
from _distributed_models import (
    EMB_PARAMS,
    collective_lines,
    emb_batch,
    emb_step,
    init_state,
    mark_phase,
    trace,
)
from recir.transforms import OVERRIDE_KEY, Pipeline, TransformResult, VerificationError, verify

MESH2 = rd.Mesh(axes={"data": 2})


def test_shard_tables_table_wise_snapshot():
    step = emb_step(4)
    plan = rd.plan(
        step, rd.HybridParallel(tables=rd.table_wise("user.weight", owners={"user.weight": 0})), MESH2
    )
    result = rd.ShardTables(plan=plan, rank=1)(step)  # rank 1 does not hold the table
    assert result.changed and result.stats == {"sharded_tables": 1, "lookups": 1}
    verify(result.step, level=2, transform=rd.ShardTables.name)
    assert collective_lines(result.step) == "\n".join(
        [
            # ids and offsets go to the owner (uneven splits: 8 ids to rank 0, none to rank 1) ...
            "%all_to_all_single_default = _c10d_functional.all_to_all_single(%user_ids, [0, 0], [8, 0], '0')"
            "  # forward",
            "%wait_tensor_default = _c10d_functional.wait_tensor(%all_to_all_single_default)  # forward",
            "  -> %index_add_default = aten.index_add(%zeros_default_1, 0, %wait_tensor_default, "
            "%div_tensor)  # backward",
            "%all_to_all_single_default_1 = _c10d_functional.all_to_all_single(%user_offsets, [0, 0], [5, 0], '0')"
            "  # forward",
            "%wait_tensor_default_1 = _c10d_functional.wait_tensor(%all_to_all_single_default_1)  # forward",
            # ... the pooled rows come back (4 bags from rank 0) ...
            "%all_to_all_single_default_2 = _c10d_functional.all_to_all_single(%zeros_default, [4, 0], [0, 0], '0')"
            "  # forward",
            "%wait_tensor_default_2 = _c10d_functional.wait_tensor(%all_to_all_single_default_2)  # forward",
            "  -> %cat = aten.cat([%wait_tensor_default_2, %embedding_bag_1, %dense], 1)  # forward",
            # ... and the per-id gradients go to the owner, averaged over the data group per id (so the
            # table's gradient stays `zeros.index_add(0, ids, g)`, which sparsify-update makes row-wise)
            "%all_to_all_single_default_3 = _c10d_functional.all_to_all_single(%index_select_2, [0, 0], [8, 0], '0')"
            "  # backward",
            "%wait_tensor_default_3 = _c10d_functional.wait_tensor(%all_to_all_single_default_3)  # backward",
            "  -> %div_tensor = aten.div.Tensor(%wait_tensor_default_3, 2)  # backward",
        ]
    )
    sig = {s.name: s.shape for s in result.step.signature.state}
    assert sig["param:user.weight"] == (0, 4) and sig["optim:user.weight:exp_avg"] == (0, 4)
    assert sig["param:item.weight"] == (12, 4)


@pytest.mark.parametrize("scheme", ["table_wise", "row_wise", "column_wise"])
def test_shard_tables_numerics_on_one_process(world1, scheme):
    step = emb_step(4)
    plan = rd.plan(step, rd.EmbeddingSharding(scheme), rd.Mesh(axes={"data": 1}))
    dstep = rd.ShardTables(plan=plan, rank=0)(step).step
    ref = got = step.load_state_dict(init_state(EMB_PARAMS))
    for k in range(3):
        ref, ref_out = step(ref, emb_batch(4, k))
        got, got_out = dstep(got, emb_batch(4, k))
    for slot, a, b in zip(step.signature.state, ref, got):
        assert torch.allclose(a, b, atol=1e-6), (scheme, slot.name)
    assert torch.allclose(ref_out[0], got_out[0])


def _aten_lookup(state, batch):  # noqa: ANN001, ANN202
    (t,) = state
    (ids,) = batch
    t = t.detach().requires_grad_(True)
    loss = torch.nn.functional.embedding(ids, t).pow(2).mean()
    mark_phase("backward")
    (g,) = torch.autograd.grad(loss, [t])
    mark_phase("optimizer")
    return [(t - 0.1 * g).detach()], [loss.detach()], [g]


def test_shard_tables_needs_recir_lookups():
    step = trace(
        _aten_lookup,
        {"param:t.weight": ("param", torch.randn(8, 2))},
        {"ids": ("ids", torch.tensor([1, 2, 5]))},
        1,
        ["loss"],
    )
    plan = rd.plan(step, rd.row_wise(), MESH2)
    assert plan.tables == [] and plan.slots["param:t.weight"]["placement"] == "replicate"  # a dense param
    plan.tables.append("param:t.weight")  # a hand-edited plan that shards it anyway
    plan.slots["param:t.weight"] = {
        "placement": "shard",
        "axis": "data",
        "dim": 0,
        "num_shards": 2,
        "scheme": "row_wise",
    }
    with pytest.raises(
        rd.ConfigError,
        match=r"table 'param:t.weight' is sharded but no recir::embedding_bag or recir::embedding",
    ):
        rd.ShardTables(plan=plan, rank=0)(step)


class _DropsOverride(rd.ShardTables):
    """Deliberately broken: the per-device lookups lose their recir.override metadata."""

    def run(self, step):  # noqa: ANN001, ANN201
        result = super().run(step)
        for node in result.step.graph.nodes:
            node.meta.pop(OVERRIDE_KEY, None)
        return TransformResult(result.step, True, result.stats)


def test_broken_shard_tables_is_caught_by_the_verifier():
    step = emb_step(4)
    plan = rd.plan(step, rd.row_wise(), MESH2)
    with pytest.raises(VerificationError, match="INV-6") as info:
        Pipeline([_DropsOverride(plan=plan)], verify_level=2).run(step)
    assert info.value.transform == "recir-dist-shard-tables"
