"""The ``ring_shift`` embedding backend end to end: a captured step with row-sharded tables, compiled for
8 JAX host devices, trains like eager ``torch.optim`` on ``nn.EmbeddingBag`` (``-m tpu``).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

jax = pytest.importorskip("jax")

import recir.distributed as rd  # noqa: E402
from recir.capture import capture_train_step  # noqa: E402
from recir.embedding import EmbeddingBagOverride  # noqa: E402
from recir.lower_tpu import compile  # noqa: E402
from recir.transforms import ConfigError  # noqa: E402

_EIGHT = pytest.mark.skipif(
    jax.device_count() < 8,
    reason=f"needs 8 JAX devices, found {jax.device_count()} (run with JAX_PLATFORMS=cpu "
    "XLA_FLAGS=--xla_force_host_platform_device_count=8, as `nox -s tpu` does)",
)
B = 8


class _Bags(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.EmbeddingBag(32, 4, mode="sum")
        self.b = nn.EmbeddingBag(16, 4, mode="mean")
        self.fc = nn.Linear(8, 1)

    def forward(self, bt: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ea = self.a(bt["ids_a"], bt["off_a"][:-1])
        eb = self.b(bt["ids_b"], bt["off_b"][:-1])
        return self.fc(torch.cat([ea, eb], 1)).squeeze(-1), ea, eb


def _loss(model: nn.Module, bt: dict[str, torch.Tensor]):
    pred, ea, eb = model(bt)
    return ((pred - bt["y"]) ** 2).mean(), ea, eb


def _offsets(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """B+1 offsets of ``lengths`` whose last bag absorbs the rest of ``total`` ids (static shapes)."""
    off = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return torch.cat([off[:-1], torch.tensor([total])])


def _batch(k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return {
        "ids_a": torch.randint(0, 32, (16,), generator=g),  # 16 ids: 2 per device
        "off_a": _offsets(torch.randint(0, 3, (B,), generator=g).clamp(max=2), 16),
        "ids_b": torch.randint(0, 16, (12,), generator=g),  # 12 ids: padded to 16 for the ring
        "off_b": _offsets(torch.randint(1, 2, (B,), generator=g), 12),
        "y": torch.randn(B, generator=g),
    }


def _setup(opt_name: str, tables: tuple[str, ...] = (), axes: dict[str, int] | None = None):
    torch.manual_seed(0)
    model = _Bags()
    opt_cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}[opt_name]
    ref_model = copy.deepcopy(model)
    opt, ref_opt = opt_cls(model.parameters(), lr=0.1), opt_cls(ref_model.parameters(), lr=0.1)
    step = capture_train_step(model, opt, _loss, _batch(0), overrides=[EmbeddingBagOverride()])
    plan = rd.plan(step, rd.row_wise(*tables), rd.Mesh(axes=axes or {"data": 8}), batch="global")
    return model, opt, ref_model, ref_opt, step, plan


def _check_parity(opt_name: str, axes: dict[str, int], steps: int) -> None:
    model, opt, ref_model, ref_opt, step, plan = _setup(opt_name, axes=axes)
    # a jax Mesh over the first devices (a 1-device mesh also runs where JAX has 8)
    devices = int(np.prod(list(axes.values())))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]).reshape(tuple(axes.values())), tuple(axes))
    compiled = compile(step, plan, mesh=mesh, embedding_backend="ring_shift")
    ops = {str(n.target) for n in compiled.step.graph.nodes if n.op == "call_function"}
    assert "recir.ring_shift_embedding_bag.default" in ops and "recir.embedding_bag.default" not in ops
    # the row update reads and writes the tables (and Adagrad's state) in their owner shards by the ring
    assert "recir.ring_shift_index_add.default" in ops and "aten.index_put.default" not in ops
    state = compiled.init_state(model, opt)
    if devices > 1:  # param:a.weight lives row-sharded; ids and partial rows really travel the ring
        assert tuple(state[0].sharding.spec) == ("model" if "model" in axes else "data",)
        assert "collective_permute" in compiled.lower().as_text()
    for k in range(steps):
        bt = _batch(k)
        state, (loss, ea, eb) = compiled(state, bt)
        ref_opt.zero_grad()
        ref_loss, ref_ea, ref_eb = _loss(ref_model, bt)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(ea, ref_ea.detach(), rtol=1e-5, atol=1e-6, msg=f"step {k}: sum bags")
        torch.testing.assert_close(eb, ref_eb.detach(), rtol=1e-5, atol=1e-6, msg=f"step {k}: mean bags")
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6, msg=f"step {k}: loss")
    sd = compiled.state_dict(state)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(sd[f"param:{name}"], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
        if opt_name == "adagrad":
            want = ref_opt.state[p]["sum"]
            torch.testing.assert_close(sd[f"optim:{name}:sum"], want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.tpu
@_EIGHT
@pytest.mark.parametrize(
    ("opt_name", "axes"),
    [("sgd", {"data": 8}), ("adagrad", {"data": 8}), ("adagrad", {"data": 2, "model": 4})],
    ids=["sgd-data8", "adagrad-data8", "adagrad-data2xmodel4"],
)
def test_ring_shift_trains_like_torch_optim(opt_name: str, axes: dict[str, int]) -> None:
    _check_parity(opt_name, axes, steps=10)


def test_ring_shift_on_a_one_device_mesh() -> None:
    _check_parity("adagrad", {"data": 1}, steps=3)


@pytest.mark.tpu
@_EIGHT
def test_ring_shift_refuses_tables_that_are_not_row_sharded() -> None:
    *_, step, plan = _setup("sgd", tables=("a.weight",))
    with pytest.raises(ConfigError, match="table 'param:b.weight'.*not row-wise sharded"):
        compile(step, plan, mesh=plan.mesh, embedding_backend="ring_shift")
    with pytest.raises(ConfigError, match="needs row-wise sharded tables on a mesh"):
        compile(step, mesh=plan.mesh, embedding_backend="ring_shift")


def test_ring_shift_needs_a_row_wise_plan() -> None:
    torch.manual_seed(0)
    model = _Bags()
    step = capture_train_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        _loss,
        _batch(0),
        overrides=[EmbeddingBagOverride()],
    )
    with pytest.raises(ConfigError, match="needs row-wise sharded tables on a mesh"):
        compile(step, embedding_backend="ring_shift")


@pytest.mark.tpu
@_EIGHT
def test_ring_shift_sequence_lowering_over_eight_shards() -> None:
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from recir.lower_tpu._ring_shift import ring_mesh, ring_shift_embedding

    mesh = Mesh(np.array(jax.devices()[:8]), ("model",))
    table = jnp.arange(16 * 3, dtype=jnp.float32).reshape(16, 3)
    ids = jnp.array([3, 15, 0, 7, 7, 9, 12, 1, 4, 2, 11])  # 11 ids: padded to 16 for the ring

    def lookup(t, i):
        with ring_mesh(mesh):
            return ring_shift_embedding(t, i, "model")

    np.testing.assert_array_equal(np.asarray(jax.jit(lookup)(table, ids)), np.asarray(table)[np.asarray(ids)])
    # the row update's ops, also on a 1-D slot (RowWiseAdagrad's one value per row)
    from recir.lower_tpu._ring_shift import ring_shift_index_add

    def update(t, i, u):
        with ring_mesh(mesh):
            return ring_shift_embedding(t, i, "model"), ring_shift_index_add(t, i, u, "model")

    for t in (table, table[:, 0]):
        upd = jnp.arange(ids.shape[0] * (t.size // 16), dtype=t.dtype).reshape(ids.shape[0], *t.shape[1:])
        rows, added = jax.jit(update)(t, ids, upd)
        np.testing.assert_array_equal(np.asarray(rows), np.asarray(t)[np.asarray(ids)])
        np.testing.assert_array_equal(np.asarray(added), np.asarray(t.at[ids].add(upd)))  # 7 twice: summed
    with pytest.raises(ConfigError, match="has no mesh with that axis.*Fix: compile the step with its"):
        ring_shift_embedding(table, ids, "model")
    with ring_mesh(mesh), pytest.raises(ConfigError, match="15 rows does not split over the 8 devices"):
        ring_shift_embedding(table[:15], ids, "model")
