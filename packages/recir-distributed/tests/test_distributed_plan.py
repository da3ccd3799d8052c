"""Meshes, parallel modes and ShardingPlans: placements, the printed table, JSON, auto placement and errors."""

from __future__ import annotations

import pytest
import recir.distributed as rd
from _distributed_models import emb_step, mlp_step
from recir.transforms import GRAD_OF_KEY, SHARDING_KEY, ConfigError, DataError


@pytest.fixture(scope="module")
def emb():
    return emb_step(4)


def test_mesh_axes_and_validation():
    mesh = rd.Mesh(axes={"data": 2, "model": 2})
    assert mesh.size == 4 and mesh.data_size == 2 and mesh.model_size == 2
    assert mesh.coords(3) == {"data": 1, "model": 1} and mesh.coords(1) == {"data": 0, "model": 1}
    assert rd.Mesh(data=4).validate(4) is not None
    with pytest.raises(ConfigError, match=r"needs 4 devices, but there are 2 processes.*data.: 2"):
        mesh.validate(2)
    with pytest.raises(ConfigError, match="positive int"):
        rd.Mesh(axes={"data": 0})
    with pytest.raises(ConfigError, match="not one of"):
        rd.Mesh(axes={"pipeline": 2})
    with pytest.raises(ConfigError, match="rank 4 is outside"):
        mesh.coords(4)


def test_fsdp_plan_shards_params_and_optimizer_state():
    step = mlp_step(4)
    plan = rd.plan(step, rd.FullyShardedDataParallel(), rd.Mesh(axes={"data": 2}))
    w = plan.slots["param:fc1.weight"]
    assert w == {
        "placement": "shard",
        "axis": "data",
        "dim": 0,
        "num_shards": 2,
        "scheme": "fsdp",
        "grad": "reduce_scatter",
    }
    assert plan.slots["optim:fc1.weight:exp_avg_sq"]["scheme"] == "fsdp"
    # one row cannot split two ways: replicated, averaged with an all-reduce, and explained
    assert plan.slots["param:head.weight"] == {"placement": "replicate", "grad": "all_reduce"}
    assert any("head.weight" in e for e in plan.explanation)
    assert plan.slots["optim:step"] == {"placement": "replicate"}
    assert plan.local_shape("param:fc1.weight", 1) == (4, 4)
    # the plan is also on the graph: placeholders, gradient nodes, batch
    ph = next(n for n in step.graph.nodes if n.name == "param_fc1_weight")
    assert ph.meta[SHARDING_KEY]["scheme"] == "fsdp"
    grads = [n for n in step.graph.nodes if n.meta.get(GRAD_OF_KEY) == "param:fc1.weight"]
    assert grads[0].meta[SHARDING_KEY]["role"] == "gradient"
    dense = next(n for n in step.graph.nodes if n.name == "dense")
    assert dense.meta[SHARDING_KEY] == {
        "placement": "shard",
        "axis": "data",
        "dim": 0,
        "num_shards": 2,
        "role": "dense",
    }


def test_table_schemes(emb):
    mesh = rd.Mesh(axes={"data": 2})
    tw = rd.plan(emb, rd.HybridParallel(tables=rd.table_wise(owners={"user.weight": 1})), mesh)
    assert tw.tables == ["param:user.weight", "param:item.weight"]
    assert tw.slots["param:user.weight"]["owner"] == 1 and tw.slots["param:item.weight"]["owner"] == 0
    assert tw.local_shape("param:user.weight", 0) == (0, 4)
    assert tw.slots["param:fc1.weight"]["placement"] == "replicate"
    rw = rd.plan(emb, rd.row_wise("item.weight"), mesh)
    assert rw.slots["param:item.weight"]["scheme"] == "row_wise"
    assert rw.slots["optim:item.weight:exp_avg"]["scheme"] == "row_wise"
    assert rw.slots["param:user.weight"]["placement"] == "replicate"
    hybrid = rd.plan(
        emb, rd.HybridParallel(tables=rd.table_wise(), dense=rd.FullyShardedDataParallel()), mesh
    )
    assert hybrid.slots["param:user.weight"]["scheme"] == "table_wise"
    assert hybrid.slots["param:fc1.weight"]["scheme"] == "fsdp"
    assert hybrid.slots["param:head.weight"]["placement"] == "replicate"
    cw = rd.plan(emb, "column_wise", mesh)
    assert cw.local_shape("param:user.weight", 1) == (16, 2)
    lookups = [n for n in emb.graph.nodes if n.meta.get(SHARDING_KEY, {}).get("role") == "lookup"]
    assert len(lookups) == 2 and lookups[0].meta[SHARDING_KEY]["scheme"] == "column_wise"


def test_plan_prints_a_table_and_round_trips_json(emb, tmp_path):
    plan = rd.plan(emb, rd.HybridParallel(tables=rd.row_wise()), rd.Mesh(axes={"data": 2}))
    text = str(plan)
    lines = text.splitlines()
    assert lines[1].split() == ["slot", "/", "table", "rows", "dim", "sharding", "bytes/device"]
    row = next(line for line in lines if line.startswith("param:user.weight"))
    assert row.split()[:5] == ["param:user.weight", "[table]", "16", "4", "row_wise(dim=0,"]
    assert row.endswith("128 B")  # 8 rows x 4 floats on each device
    assert "total per device: 0:" in text
    path = tmp_path / "plan.json"
    plan.save(path)
    again = rd.ShardingPlan.load(path)
    assert again == plan and again.local_shape("param:user.weight", 1) == (8, 4)
    assert str(again) == text


def test_plan_save_is_atomic_and_plans_are_checked_by_type(emb, tmp_path, monkeypatch):
    plan = rd.plan(emb, rd.HybridParallel(tables=rd.row_wise()), rd.Mesh(axes={"data": 2}))
    path = tmp_path / "plan.json"
    plan.save(path)
    before = path.read_text()
    other = rd.plan(emb, rd.DataParallel(), rd.Mesh(axes={"data": 2}))

    def crash(src, dst):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr("os.replace", crash)
    with pytest.raises(OSError, match="disk full"):
        other.save(path)
    assert path.read_text() == before  # a failed save leaves the old plan whole
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # and no temporary behind
    monkeypatch.undo()
    assert rd.as_plan(None, "x") is None and rd.as_plan(plan, "x") is plan
    with pytest.raises(
        rd.ConfigError, match=r"lower: plan must be a recir.distributed.ShardingPlan, got dict"
    ):
        rd.as_plan(plan.to_dict(), "lower")


def test_auto_places_tables_by_size_and_explains(emb):
    mesh = rd.Mesh(axes={"data": 2})
    plan = rd.plan(emb, "auto", mesh, memory_budget=2200)
    # dense state (1.2 KiB) is on both devices; user (768 B with Adam state) goes whole to device 0, item
    # (576 B) whole to device 1
    assert plan.slots["param:user.weight"]["scheme"] == "table_wise"
    assert plan.slots["param:item.weight"]["owner"] == 1
    assert any("table_wise on device 0" in e for e in plan.explanation)
    tight = rd.plan(emb, "auto", mesh, memory_budget=1950)
    assert tight.slots["param:user.weight"]["scheme"] == "row_wise"
    assert any("row_wise over 2 devices" in e for e in tight.explanation)
    assert tight.slots["param:item.weight"]["scheme"] == "row_wise"
    assert max(tight.bytes_per_device()) <= 1950


def test_over_budget_names_the_table_and_numbers(emb):
    mesh = rd.Mesh(axes={"data": 2})
    with pytest.raises(
        ConfigError, match=r"table 'param:user.weight' \(16 x 4, 768 bytes.*budget of 1300 bytes"
    ):
        rd.plan(emb, "auto", mesh, memory_budget=1300)
    with pytest.raises(
        ConfigError, match=r"device 0 holds .* budget is .*largest slot is 'param:fc1.weight'"
    ):
        rd.plan(emb, rd.DataParallel(), mesh, memory_budget=1000)


def test_gpu_path_needs_a_one_dimensional_mesh(emb):
    plan = rd.plan(emb, rd.DataParallel(), rd.Mesh(axes={"data": 2, "model": 2}))
    with pytest.raises(ConfigError, match="supports one active mesh axis"):
        rd.distribute(emb, plan, 0)


def test_batch_and_scheme_errors(emb):
    mesh = rd.Mesh(axes={"data": 3})
    with pytest.raises(
        ConfigError, match=r"4 samples, not divisible by the data-parallel size 3.*e.g. 3 or 6"
    ):
        rd.plan(emb, rd.DataParallel(), mesh, batch="global")
    with pytest.raises(ConfigError, match=r"row_wise needs dim 0 \(16\) divisible by the 3 devices"):
        rd.plan(emb, rd.row_wise("user.weight"), mesh)
    plan = rd.plan(emb, rd.DataParallel(), rd.Mesh(axes={"data": 2}))
    import torch

    with pytest.raises(DataError, match="5 samples .* does not split over the data-parallel size 2"):
        rd.split_batch(plan, {"x": torch.zeros(5, 3)}, 0)
    part = rd.split_batch(plan, {"x": torch.arange(8.0).view(4, 2)}, 1)
    assert part["x"].tolist() == [[4.0, 5.0], [6.0, 7.0]]
    with pytest.raises(ConfigError, match="unknown parallel mode 'pipeline'"):
        rd.plan(emb, "pipeline", mesh)


def test_split_batch_splits_jagged_batches_by_data_coordinate():
    import torch
    from recir.embedding import JaggedBatch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.arange(9), lengths=torch.tensor([1, 2, 0, 1, 2, 0, 3, 0])
    )  # B=4: a = [0] [1 2] [] [3], b = [4 5] [] [6 7 8] []
    batch = {"f": JaggedBatch.from_kjt(kjt, [6, 6]), "x": torch.arange(4.0), "t": torch.tensor(1.0)}
    step = mlp_step(2)
    # a 2 x 2 mesh: ranks 2 and 3 sit at data coordinate 1 and take the second half
    plan = rd.plan(step, rd.DataParallel(), rd.Mesh(axes={"data": 2, "model": 2}))
    for rank, want_a, want_b in [(0, [[0], [1, 2]], [[4, 5], []]), (3, [[], [3]], [[6, 7, 8], []])]:
        part = rd.split_batch(plan, batch, rank)
        f = part["f"]
        assert f.batch_size == 2 and f.capacities == (6, 6) and part["t"] is batch["t"]
        assert [t.tolist() for t in f.to_jagged_tensors()["a"].to_dense()] == want_a
        assert [t.tolist() for t in f.to_jagged_tensors()["b"].to_dense()] == want_b
        assert part["x"].tolist() == ([0.0, 1.0] if rank == 0 else [2.0, 3.0])
    odd = rd.plan(step, rd.DataParallel(), rd.Mesh(axes={"data": 3}))
    with pytest.raises(DataError, match="batch size 4 does not split into 3 equal parts"):
        rd.split_batch(odd, {"f": batch["f"]}, 0)
