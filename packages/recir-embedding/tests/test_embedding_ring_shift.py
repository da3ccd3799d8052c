"""The ring_shift lookup (JAX shard_map + ppermute ring, Pallas gather in interpret mode off-TPU)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")


def _lookup(n_devices: int, rows: int, n_ids: int):
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from recir.embedding import ring_shift_lookup

    mesh = Mesh(np.array(jax.devices()[:n_devices]), ("model",))
    table = jnp.arange(rows * 3, dtype=jnp.float32).reshape(rows, 3)
    ids = jax.random.randint(jax.random.key(0), (n_ids,), 0, rows).at[1].set(rows)  # one id out of range
    t = jax.device_put(table, NamedSharding(mesh, P("model", None)))
    i = jax.device_put(ids, NamedSharding(mesh, P("model")))
    out = jax.jit(lambda a, b: ring_shift_lookup(a, b, mesh, "model"))(t, i)
    want = np.asarray(table)[np.clip(np.asarray(ids), 0, rows - 1)]
    want[1] = 0.0  # out-of-range ids give zero rows
    np.testing.assert_array_equal(np.asarray(out), want)
    return out


def test_ring_shift_on_one_device():
    _lookup(1, rows=10, n_ids=6)


@pytest.mark.tpu
def test_ring_shift_over_eight_row_shards():
    if jax.device_count() < 8:
        pytest.skip(
            "needs 8 JAX devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, as `nox -s tpu`)"
        )
    out = _lookup(8, rows=64, n_ids=32)
    assert out.sharding.spec[0] == "model"
