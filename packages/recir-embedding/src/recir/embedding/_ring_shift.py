"""The ``ring_shift`` lookup for the TPU path: row-sharded tables, ids passed around a device ring.

Each device keeps its table shard; the batch's ids (sharded like the batch) and their partial results
travel one hop per step (``ppermute``), and each device fills in the rows it owns with a Pallas gather
kernel (interpret mode off-TPU). After ``n`` hops every id has met every shard and is back home.
The ``recir::ring_shift_*`` graph ops mark lookups of row-sharded tables for recir.lower_tpu.
"""

from __future__ import annotations

from typing import Any

import torch
from recir.transforms import embedding_bag_reference, register_override_op
from torch import Tensor


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


# -- graph ops: the lookups prepare_for_lowering(backend="ring_shift") puts in a StepGraph ----------------
RING_SHIFT_BACKEND = "recir-embedding-ring_shift"


def ring_shift_embedding_bag_reference(
    weight: Tensor, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None, mode: int, axis: str
) -> Tensor:
    """Pure-ATen form (``recir::embedding_bag``'s reference); ``axis`` only matters to the JAX lowering."""
    del axis
    return embedding_bag_reference(weight, indices, offsets, per_sample_weights, mode)


def ring_shift_embedding_reference(weight: Tensor, ids: Tensor, axis: str) -> Tensor:
    """Pure-ATen form: ``weight[ids]``."""
    del axis
    return weight.index_select(0, ids)


@torch.library.custom_op("recir::ring_shift_embedding_bag", mutates_args=())
def ring_shift_embedding_bag(
    weight: Tensor, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None, mode: int, axis: str
) -> Tensor:
    """``recir::embedding_bag`` of a table row-sharded over mesh axis ``axis`` (forward only).

    Eagerly the plain lookup; recir.lower_tpu lowers it to ``ring_shift_lookup`` plus per-bag pooling.
    """
    return ring_shift_embedding_bag_reference(weight, indices, offsets, per_sample_weights, mode, axis)


@ring_shift_embedding_bag.register_fake
def _ring_bag_fake(weight, indices, offsets, per_sample_weights, mode, axis):
    return weight.new_empty(offsets.shape[0] - 1, weight.shape[1])


@torch.library.custom_op("recir::ring_shift_embedding", mutates_args=())
def ring_shift_embedding(weight: Tensor, ids: Tensor, axis: str) -> Tensor:
    """``recir::embedding`` of a table row-sharded over mesh axis ``axis`` (forward only)."""
    return ring_shift_embedding_reference(weight, ids, axis)


@ring_shift_embedding.register_fake
def _ring_emb_fake(weight, ids, axis):
    return weight.new_empty(ids.shape[0], weight.shape[1])


for _op in ("ring_shift_embedding_bag", "ring_shift_embedding"):
    register_override_op(f"recir::{_op}", RING_SHIFT_BACKEND)
