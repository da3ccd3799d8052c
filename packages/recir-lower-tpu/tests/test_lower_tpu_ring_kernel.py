"""The ring shift's Pallas kernels (gather, scatter-add; table in HBM, ids in blocks, rows by DMA) and
``ring_shift_lookup`` with its backward, against ``jnp.take`` on awkward shapes, in both interpret modes:
Pallas's HLO interpreter (the default off-TPU) and TPU interpret mode (``pltpu.InterpretParams``, which
simulates HBM/VMEM, DMAs that land only when waited on, semaphores, and detects races).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from recir.lower_tpu import (  # noqa: E402
    local_gather,
    local_scatter_add,
    ring_shift_lookup,
    ring_shift_scatter_add,
)

ROWS, DIM = 24, 5
HLO = True
TPU_SIM = pltpu.InterpretParams(detect_races=True)
MODES = pytest.mark.parametrize("interpret", [HLO, TPU_SIM], ids=["hlo-interpret", "tpu-interpret"])

# name -> ids (local to a shard of ROWS rows); block is 8 in every case
CASES = {
    "not_a_multiple_of_the_block": np.array([3, 17, 0, 23, 5, 9, 12, 1, 4, 2, 11, 20, 7]),
    "owning_none": np.array([-1, 24, 99, -7, 30, 25, 24, -1, 40]),
    "duplicates": np.array([5, 5, 5, 0, 5, 23, 23, 0, 5, 5, 1, 5]),
    "mixed_owned_and_not": np.array([30, 3, -2, 3, 24, 0, 23, 100, 22, -1, 3, 8, 8, 8, 8, 8, 31]),
    "one_id": np.array([7]),
}


def _table(rows: int = ROWS, dim: int = DIM, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (rows, dim), jnp.float32)


def _take(table: jax.Array, ids: np.ndarray) -> np.ndarray:
    """The reference: ``jnp.take`` of owned ids, zero rows for the others."""
    rows = table.shape[0]
    owned = (ids >= 0) & (ids < rows)
    return np.where(owned[:, None], np.asarray(jnp.take(table, np.clip(ids, 0, rows - 1), axis=0)), 0.0)


@MODES
@pytest.mark.parametrize("case", sorted(CASES))
def test_local_gather_matches_take(case: str, interpret) -> None:
    table, ids = _table(), CASES[case]
    out = jax.jit(lambda t, i: local_gather(t, i, block=8, interpret=interpret))(table, jnp.asarray(ids))
    assert out.shape == (ids.shape[0], DIM)
    np.testing.assert_array_equal(np.asarray(out), _take(table, ids))


@MODES
@pytest.mark.parametrize("case", sorted(CASES))
def test_local_scatter_add_matches_at_add(case: str, interpret) -> None:
    """Duplicates are summed; owned rows are added to what the accumulator holds; others dropped."""
    ids = CASES[case]
    acc = _table(seed=1)
    grads = jax.random.normal(jax.random.key(2), (ids.shape[0], DIM), jnp.float32)
    fn = jax.jit(lambda a, i, g: local_scatter_add(a, i, g, block=8, interpret=interpret))
    out = fn(acc, jnp.asarray(ids), grads)
    want = np.asarray(acc).copy()
    owned = (ids >= 0) & (ids < ROWS)
    np.add.at(want, ids[owned], np.asarray(grads)[owned])
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6, atol=1e-6)


def test_kernels_take_no_ids_and_refuse_bad_blocks() -> None:
    table = _table()
    none = jnp.zeros((0,), jnp.int32)
    assert local_gather(table, none).shape == (0, DIM)
    np.testing.assert_array_equal(np.asarray(local_scatter_add(table, none, jnp.zeros((0, DIM)))), table)
    with pytest.raises(ValueError, match="block must be a positive multiple of 8.*got 12"):
        local_gather(table, jnp.arange(4), block=12)


def test_default_block_and_int64_ids() -> None:
    """Default block (128): 300 ids span three grid steps, the last one partial; int64 ids under x64."""
    table = _table(rows=64)
    ids = np.random.default_rng(0).integers(-4, 70, size=300)
    with jax.enable_x64(True):
        out = jax.jit(local_gather)(table, jnp.asarray(ids, dtype=jnp.int64))
    np.testing.assert_array_equal(np.asarray(out), _take(table, ids))


# -- the ring: shard_map over a mesh axis, forward and backward ----------------------------------------
def _ring_case(n: int, ids: np.ndarray, interpret) -> None:
    rows = 8 * n  # 8 rows per shard
    mesh = Mesh(np.array(jax.devices()[:n]), ("model",))
    table = _table(rows=rows, dim=3)
    t = jax.device_put(table, NamedSharding(mesh, P("model", None)))
    i = jax.device_put(jnp.asarray(ids), NamedSharding(mesh, P("model")))
    lookup = jax.jit(lambda a, b: ring_shift_lookup(a, b, mesh, "model", block=8, interpret=interpret))
    out = lookup(t, i)
    np.testing.assert_array_equal(np.asarray(out), _take(table, ids))
    if n > 1:
        assert out.sharding.spec[0] == "model"

    weights = jax.random.normal(jax.random.key(3), (ids.shape[0], 3))
    owned = jnp.asarray((ids >= 0) & (ids < rows))[:, None]

    def ref_loss(a):
        return (
            jnp.where(owned, jnp.take(a, jnp.clip(jnp.asarray(ids), 0, rows - 1), axis=0), 0.0) * weights
        ).sum()

    grad = jax.jit(jax.grad(lambda a: (lookup(a, i) * weights).sum()))(t)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(jax.grad(ref_loss)(table)), rtol=1e-5, atol=1e-6)
    if n > 1:
        assert grad.sharding.spec[0] == "model"  # each shard's gradient stays on its owner


def test_ring_on_one_device_with_gradient() -> None:
    _ring_case(1, np.array([3, 3, 7, -1, 8, 0, 5, 5, 2, 6, 1]), HLO)


def _eight() -> None:
    if jax.device_count() < 8:
        pytest.skip(
            "needs 8 JAX devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, as `nox -s tpu`)"
        )


RING_CASES = {
    # 11 ids per device: not a multiple of the block (8); ids anywhere in 64 rows, two out of range
    "spread": np.concatenate([np.random.default_rng(1).integers(0, 64, size=86), [64, -3]]),
    # every id owned by shard 3 (rows 24..31): the other seven shards own none of them
    "all_on_one_shard": np.random.default_rng(2).integers(24, 32, size=88),
    # the same few rows over and over, from every device
    "duplicates": np.tile(np.array([5, 5, 40, 63, 0, 40, 5, 5]), 11),
}


@pytest.mark.tpu
@pytest.mark.parametrize("case", sorted(RING_CASES))
def test_ring_over_eight_shards_matches_take(case: str) -> None:
    _eight()
    _ring_case(8, RING_CASES[case], HLO)


@pytest.mark.tpu
@pytest.mark.parametrize("case", sorted(RING_CASES))
def test_ring_scatter_add_over_eight_shards(case: str) -> None:
    """Every device's rows go round the ring into their owners' shards, duplicates summed."""
    _eight()
    ids = RING_CASES[case]
    mesh = Mesh(np.array(jax.devices()[:8]), ("model",))
    table = _table(rows=64, dim=3)
    updates = jax.random.normal(jax.random.key(4), (ids.shape[0], 3))
    t = jax.device_put(table, NamedSharding(mesh, P("model", None)))
    i = jax.device_put(jnp.asarray(ids), NamedSharding(mesh, P("model")))
    u = jax.device_put(updates, NamedSharding(mesh, P("model", None)))
    out = jax.jit(lambda a, b, c: ring_shift_scatter_add(a, b, c, mesh, "model", block=8))(t, i, u)
    owned = (ids >= 0) & (ids < 64)
    want = np.asarray(table).copy()
    np.add.at(want, ids[owned], np.asarray(updates)[owned])
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6, atol=1e-6)
    assert out.sharding.spec[0] == "model"


@pytest.mark.tpu
def test_ring_over_eight_shards_in_tpu_interpret_mode() -> None:
    """The DMA/semaphore simulation with race detection, forward and backward, on 8 devices."""
    _eight()
    _ring_case(8, RING_CASES["all_on_one_shard"][:16], TPU_SIM)


# -- lowering for a TPU without one: jax.export for platform "tpu" runs Pallas's Mosaic lowering ---------
def _tpu_mesh(n: int):
    from jax.sharding import AbstractDevice, AbstractMesh

    device = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    return AbstractMesh((n,), ("x",), abstract_device=device)


@pytest.mark.parametrize(
    ("dim", "dtype"), [(1, jnp.float32), (16, jnp.float32), (128, jnp.bfloat16), (512, jnp.float32)]
)
def test_kernels_lower_to_mosaic_for_a_tpu(dim: int, dtype) -> None:
    """Mosaic's rules hold (HBM touched only by DMA, ids read as SMEM scalars, legal block shapes):
    interpret mode would accept a kernel that loads the table from HBM; this lowering refuses it."""
    table = jax.ShapeDtypeStruct((1024, dim), dtype)
    ids = jax.ShapeDtypeStruct((300,), jnp.int32)
    grads = jax.ShapeDtypeStruct((300, dim), dtype)
    with jax.sharding.use_abstract_mesh(_tpu_mesh(1)):
        gather = jax.export.export(
            jax.jit(lambda t, i: local_gather(t, i, interpret=False)), platforms=["tpu"]
        )(table, ids)
        scatter = jax.export.export(
            jax.jit(lambda t, i, g: local_scatter_add(t, i, g, interpret=False)), platforms=["tpu"]
        )(table, ids, grads)
    for exported in (gather, scatter):
        assert exported.platforms == ("tpu",)
        assert "tpu_custom_call" in exported.mlir_module()  # the kernel, compiled by Mosaic on a TPU


def test_ring_lowers_for_eight_tpus() -> None:
    """The whole ring, forward and custom_vjp backward, as one program for 8 TPU devices."""
    mesh = _tpu_mesh(8)
    table = jax.ShapeDtypeStruct((1024, 128), jnp.float32, sharding=NamedSharding(mesh, P("x", None)))
    ids = jax.ShapeDtypeStruct((512,), jnp.int32, sharding=NamedSharding(mesh, P("x")))

    def loss(t, i):
        return ring_shift_lookup(t, i, mesh, "x", interpret=False).sum()

    with jax.sharding.use_abstract_mesh(mesh):
        exported = jax.export.export(jax.jit(jax.value_and_grad(loss)), platforms=["tpu"])(table, ids)
    text = exported.mlir_module()
    assert exported.nr_devices == 8
    assert text.count("tpu_custom_call") == 2  # the gather kernel (forward) and the scatter-add (backward)
    assert "collective_permute" in text
