"""The ``ring_shift`` lookup for the TPU path: row-sharded tables, ids passed around a device ring.

Each device keeps its table shard; the batch's ids (sharded like the batch) and their partial results
travel one hop per step (``ppermute``), and each device fills in the rows it owns with a Pallas gather
kernel (interpret mode off-TPU). After ``n`` hops every id has met every shard and is back home.
"""

from __future__ import annotations

from typing import Any


def _jax() -> Any:
    try:
        import jax
    except ImportError as e:
        raise ImportError(
            "the 'ring_shift' embedding backend needs JAX: install the recir-lower-tpu dependencies "
            "(jax, torchax)"
        ) from e
    return jax


def _gather_kernel(ids_ref: Any, table_ref: Any, out_ref: Any) -> None:
    import jax.numpy as jnp

    ids = ids_ref[...]
    rows = table_ref.shape[0]
    owned = (ids >= 0) & (ids < rows)
    vals = jnp.take(table_ref[...], jnp.clip(ids, 0, rows - 1), axis=0)
    out_ref[...] = jnp.where(owned[:, None], vals, jnp.zeros_like(vals))


def local_gather(shard: Any, local_ids: Any, *, interpret: bool | None = None) -> Any:
    """Rows ``shard[local_ids]`` for ids inside the shard, zeros elsewhere (a Pallas kernel)."""
    jax = _jax()
    from jax.experimental import pallas as pl

    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    out = jax.ShapeDtypeStruct((local_ids.shape[0], shard.shape[1]), shard.dtype)
    return pl.pallas_call(_gather_kernel, out_shape=out, interpret=interpret)(local_ids, shard)


def ring_shift_lookup(table: Any, ids: Any, mesh: Any, axis: str, *, interpret: bool | None = None) -> Any:
    """``table[ids]`` with ``table`` row-sharded and ``ids`` sharded over mesh axis ``axis``.

    ``table``: ``[rows, D]`` (rows divisible by the axis size), ``ids``: ``[N]`` (N divisible too).
    Returns ``[N, D]`` sharded like ``ids``. Ids outside ``[0, rows)`` give zero rows.
    """
    jax = _jax()
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    n = mesh.shape[axis]
    rows_per = table.shape[0] // n
    ring = [(i, (i + 1) % n) for i in range(n)]

    def per_device(shard: Any, my_ids: Any) -> Any:
        base = jax.lax.axis_index(axis) * rows_per

        def hop(_: int, carry: tuple[Any, Any]) -> tuple[Any, Any]:
            ids_c, acc = carry
            acc = acc + local_gather(shard, ids_c - base, interpret=interpret)
            return jax.lax.ppermute(ids_c, axis, ring), jax.lax.ppermute(acc, axis, ring)

        acc0 = jnp.zeros((my_ids.shape[0], shard.shape[1]), shard.dtype)
        _, acc = jax.lax.fori_loop(0, n, hop, (my_ids, acc0))
        return acc

    fn = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(axis, None), P(axis)), out_specs=P(axis, None), check_vma=False
    )
    return fn(table, ids)
