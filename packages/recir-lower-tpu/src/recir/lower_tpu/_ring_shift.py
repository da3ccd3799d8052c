"""The ``ring_shift`` embedding backend on the TPU path: lowerings of recir-embedding's
``recir::ring_shift_*`` lookups and row updates to ``ring_shift_lookup`` / ``ring_shift_scatter_add``
(``_ring_kernel.py``).

Row-sharded tables come from the plan; the mesh reaches the lowerings through a context that
``TPUCompiledStep`` sets while JAX traces the step.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
from recir.distributed import ShardingPlan
from recir.transforms import ConfigError

from ._lowerings import pool_bags
from ._registry import register_jax_lowering
from ._ring_kernel import ring_shift_lookup, ring_shift_scatter_add

_MESH: contextvars.ContextVar[Any] = contextvars.ContextVar("recir_lower_tpu_ring_mesh", default=None)


def row_sharded_tables(plan: ShardingPlan | None) -> dict[str, str]:
    """State slot -> mesh axis of every slot the plan shards row-wise (``{}`` without a plan)."""
    slots = plan.slots if plan is not None else {}
    return {
        name: str(sh.get("axis", "data"))
        for name, sh in slots.items()
        if sh.get("placement") == "shard" and sh.get("scheme") == "row_wise" and int(sh.get("dim", 0)) == 0
    }


@contextlib.contextmanager
def ring_mesh(mesh: Any) -> Iterator[None]:
    """Make ``mesh`` (a jax Mesh, or None) the one ``recir::ring_shift_*`` lowerings shard over."""
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


def with_ring_mesh(fn: Callable[..., Any], mesh: Any) -> Callable[..., Any]:
    """``fn`` traced with ``mesh`` as the ring mesh (what ``jax.jit`` wraps)."""

    def traced(*args: Any) -> Any:
        with ring_mesh(mesh):
            return fn(*args)

    traced.__name__ = getattr(fn, "__name__", "jax_step")
    return traced


def _ring(weight: Any, axis: str) -> Any:
    """The mesh the step's ring runs over, checked against ``weight``'s rows."""
    mesh = _MESH.get()
    if mesh is None or axis not in mesh.shape:
        raise ConfigError(
            f"recir::ring_shift lookup over mesh axis {axis!r} has no mesh with that axis "
            f"(mesh: {None if mesh is None else dict(mesh.shape)}). Fix: compile the step with its "
            "row-wise plan: recir.lower_tpu.compile(step, plan, mesh=plan.mesh, embedding_backend='ring_shift')."
        )
    n = mesh.shape[axis]
    if weight.shape[0] % n:
        raise ConfigError(
            f"recir::ring_shift: a table of {weight.shape[0]} rows does not split over the {n} devices of "
            f"mesh axis {axis!r}. Fix: pad the table to a multiple of {n} rows."
        )
    return mesh


def _padded(ids: Any, n: int, rows: Any = None) -> tuple[Any, Any]:
    """``ids`` (and their ``rows``) padded to a multiple of ``n``: id -1 belongs to no shard."""
    pad = (-ids.shape[0]) % n
    if pad:
        ids = jnp.concatenate([ids, jnp.full((pad,), -1, dtype=ids.dtype)])
        if rows is not None:
            rows = jnp.concatenate([rows, jnp.zeros((pad, *rows.shape[1:]), rows.dtype)])
    return ids, rows


def _lookup(weight: Any, ids: Any, axis: str) -> Any:
    """``weight[ids]`` by the ring; a 1-D weight (row-wise optimizer state) as one column."""
    mesh = _ring(weight, axis)
    padded, _ = _padded(ids, mesh.shape[axis])
    rows = ring_shift_lookup(weight.reshape(weight.shape[0], -1), padded, mesh, axis)[: ids.shape[0]]
    return rows.reshape(ids.shape[0], *weight.shape[1:])


@register_jax_lowering("recir::ring_shift_index_add")
def ring_shift_index_add(weight, ids, updates, axis: str):
    """``updates`` added into rows ``ids`` of their owner shards (the sparse row update's write)."""
    mesh = _ring(weight, axis)
    flat = updates.reshape(updates.shape[0], -1).astype(weight.dtype)
    padded, flat = _padded(ids, mesh.shape[axis], flat)
    out = ring_shift_scatter_add(weight.reshape(weight.shape[0], -1), padded, flat, mesh, axis)
    return out.reshape(weight.shape)


@register_jax_lowering("recir::ring_shift_embedding_bag")
def ring_shift_embedding_bag(weight, indices, offsets, per_sample_weights, mode: int, axis: str):
    """Rows from the ring, then the same per-bag pooling as ``recir::embedding_bag``."""
    return pool_bags(_lookup(weight, indices, axis), offsets, per_sample_weights, mode, indices.shape[0])


@register_jax_lowering("recir::ring_shift_embedding")
def ring_shift_embedding(weight, ids, axis: str):
    return _lookup(weight, ids, axis)
