"""The ring shift's Pallas TPU kernels and the ring itself: row gather (forward) and row scatter-add
(backward) over a table shard left in HBM; ``ring_shift_lookup``, a row-sharded ``table[ids]`` with a
``custom_vjp`` whose backward scatter-adds row gradients into the owner shard, and
``ring_shift_scatter_add``, that scatter-add on its own (the training step's row update).

Sizes: ``block`` ids per grid step (default 128). Per block the gather kernel holds in VMEM its output
block (double-buffered by Pallas: ``2 * block * D * itemsize``) and its own two row buffers
(``2 * block * D * itemsize``), so ``4 * block * D * itemsize`` bytes (1 MiB at block 128, D 512, f32),
plus ``4 * block * 4`` bytes of ids in SMEM (two id blocks, each double-buffered). The scatter-add
kernel holds its gradient block (``2 * block * D * itemsize``) and two row buffers
(``2 * block * D * itemsize``): the same. The table shard never leaves HBM; rows move by DMA.
"""

from __future__ import annotations

import functools
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

DEFAULT_BLOCK = 128  # ids per grid step; a multiple of 8 (TPU sublanes)

Interpret: TypeAlias = "bool | pltpu.InterpretParams | None"


def _interpret(interpret: Interpret) -> bool | pltpu.InterpretParams:
    """None: compiled on a TPU, else Pallas's HLO interpreter (DMAs and semaphores discharged in order)."""
    if interpret is None:
        return jax.default_backend() != "tpu"
    return interpret


def block_size(num_ids: int, block: int | None = None) -> int:
    """Ids per grid step: ``block`` (default 128), or ``num_ids`` rounded up to 8 when that is smaller."""
    block = DEFAULT_BLOCK if block is None else block
    if block <= 0 or block % 8:
        raise ValueError(f"ring shift block must be a positive multiple of 8 (TPU sublanes), got {block}")
    return min(block, max(8, -(-num_ids // 8) * 8))


def _local_ids(ids: Any, rows: int, block: int) -> Any:
    """int32 ids padded to a multiple of ``block`` with -1; anything outside ``[0, rows)`` becomes -1."""
    owned = (ids >= 0) & (ids < rows)
    ids = jnp.where(owned, ids, -1).astype(jnp.int32)
    pad = (-ids.shape[0]) % block
    return jnp.concatenate([ids, jnp.full((pad,), -1, jnp.int32)]) if pad else ids


def _id_specs(block: int) -> list[pl.BlockSpec]:
    """This grid step's id block and the next one's (for prefetching its rows), both in SMEM."""

    def next_block(i: Any) -> tuple[Any]:
        return (jnp.minimum(i + 1, pl.num_programs(0) - 1),)

    return [
        pl.BlockSpec((block,), lambda i: (i,), memory_space=pltpu.SMEM),
        pl.BlockSpec((block,), next_block, memory_space=pltpu.SMEM),
    ]


def _row_copies(ids_ref: Any, hbm: Any, vmem: Any, sem: Any, *, rows: int, start: bool, to_hbm: bool) -> None:
    """Start (or wait for) one DMA per owned id of a block: HBM row ``ids[j]`` <-> VMEM row ``j``."""

    def body(j: Any, carry: Any) -> Any:
        r = ids_ref[j]

        @pl.when((r >= 0) & (r < rows))
        def _() -> None:
            hbm_row, vmem_row = hbm.at[pl.ds(r, 1)], vmem.at[pl.ds(j, 1)]
            pair = (vmem_row, hbm_row) if to_hbm else (hbm_row, vmem_row)
            copy = pltpu.make_async_copy(*pair, sem)
            if start:
                copy.start()
            else:
                copy.wait()

        return carry

    jax.lax.fori_loop(0, ids_ref.shape[0], body, 0)


def _gather_kernel(ids_ref, next_ids_ref, table_hbm, out_ref, buf, sems):
    """Grid step i: prefetch block i+1's rows into the other buffer, wait for block i's, mask, store."""
    i, steps = pl.program_id(0), pl.num_programs(0)
    rows = table_hbm.shape[0]
    slot = i % 2
    fetch = functools.partial(_row_copies, hbm=table_hbm, rows=rows, to_hbm=False)

    @pl.when(i == 0)
    def _() -> None:
        fetch(ids_ref, vmem=buf.at[0], sem=sems.at[0], start=True)

    @pl.when(i + 1 < steps)
    def _() -> None:
        fetch(next_ids_ref, vmem=buf.at[1 - slot], sem=sems.at[1 - slot], start=True)

    fetch(ids_ref, vmem=buf.at[slot], sem=sems.at[slot], start=False)

    def store(j: Any, carry: Any) -> Any:
        r = ids_ref[j]
        row = buf[slot, pl.ds(j, 1), :]
        out_ref[pl.ds(j, 1), :] = jnp.where((r >= 0) & (r < rows), row, jnp.zeros_like(row))
        return carry

    jax.lax.fori_loop(0, ids_ref.shape[0], store, 0)


def local_gather(shard: Any, ids: Any, *, block: int | None = None, interpret: Interpret = None) -> Any:
    """``shard[ids]`` for ids inside ``[0, rows)``, zero rows for the others (the Pallas gather kernel).

    ``shard``: ``[rows, D]``, left where it is (``memory_space=ANY``: HBM on a TPU); ``ids``: ``[N]``
    integers, any count (padded to whole blocks with -1). Returns ``[N, D]``.
    """
    count, (rows, dim) = ids.shape[0], shard.shape
    if count == 0:
        return jnp.zeros((0, dim), shard.dtype)
    blk = block_size(count, block)
    padded = _local_ids(ids, rows, blk)
    out = pl.pallas_call(
        _gather_kernel,
        grid=(padded.shape[0] // blk,),
        in_specs=[*_id_specs(blk), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((blk, dim), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((padded.shape[0], dim), shard.dtype),
        scratch_shapes=[pltpu.VMEM((2, blk, dim), shard.dtype), pltpu.SemaphoreType.DMA((2,))],
        # sequential: a step waits for rows the previous step started fetching
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=_interpret(interpret),
    )(padded, padded, shard)
    return out[:count]


def _scatter_add_kernel(ids_ref, next_ids_ref, grads_ref, acc_in, acc_hbm, buf, sems):
    """Grid step i: prefetch block i+1's accumulator rows, wait for block i's, add, write back by DMA.

    Ids must be unique across the call (``local_scatter_add`` dedupes them): no two DMAs touch one row.
    """
    del acc_in  # aliased to acc_hbm
    i, steps = pl.program_id(0), pl.num_programs(0)
    rows = acc_hbm.shape[0]
    slot = i % 2
    fetch = functools.partial(_row_copies, hbm=acc_hbm, rows=rows, to_hbm=False)

    @pl.when(i == 0)
    def _() -> None:
        fetch(ids_ref, vmem=buf.at[0], sem=sems.at[0, 0], start=True)

    @pl.when(i + 1 < steps)
    def _() -> None:
        fetch(next_ids_ref, vmem=buf.at[1 - slot], sem=sems.at[0, 1 - slot], start=True)

    fetch(ids_ref, vmem=buf.at[slot], sem=sems.at[0, slot], start=False)
    buf[slot] = buf[slot] + grads_ref[...].astype(buf.dtype)
    write = functools.partial(_row_copies, ids_ref, acc_hbm, buf.at[slot], sems.at[1, slot], rows=rows)
    write(start=True, to_hbm=True)
    write(start=False, to_hbm=True)


def _dedupe(ids: Any, grads: Any, rows: int) -> tuple[Any, Any]:
    """Unique owned ids (padded with -1) and their summed gradient rows, static sizes."""
    count = ids.shape[0]
    ids = jnp.where((ids >= 0) & (ids < rows), ids, -1).astype(jnp.int32)
    uniq, inverse = jnp.unique(ids, size=count, fill_value=-1, return_inverse=True)
    summed = jax.ops.segment_sum(grads, inverse.reshape(-1), num_segments=count)
    return uniq, summed


def local_scatter_add(
    acc: Any, ids: Any, grads: Any, *, block: int | None = None, interpret: Interpret = None
) -> Any:
    """``acc.at[ids].add(grads)`` for ids inside ``[0, rows)`` (others dropped); the Pallas kernel.

    ``acc``: ``[rows, D]`` updated in place (aliased, left in HBM); duplicate ids are summed first.
    """
    count, (rows, dim) = ids.shape[0], acc.shape
    if count == 0:
        return acc
    uniq, summed = _dedupe(ids, grads, rows)
    blk = block_size(count, block)
    padded = _local_ids(uniq, rows, blk)
    summed = jnp.pad(summed, ((0, padded.shape[0] - count), (0, 0)))
    return pl.pallas_call(
        _scatter_add_kernel,
        grid=(padded.shape[0] // blk,),
        in_specs=[
            *_id_specs(blk),
            pl.BlockSpec((blk, dim), lambda i: (i, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=jax.ShapeDtypeStruct(acc.shape, acc.dtype),
        scratch_shapes=[pltpu.VMEM((2, blk, dim), acc.dtype), pltpu.SemaphoreType.DMA((2, 2))],
        input_output_aliases={3: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=_interpret(interpret),
    )(padded, padded, summed, acc)


def _ring_scatter_add(
    acc: Any, ids: Any, updates: Any, *, axis: str, rows_total: int, scatter_add: Any
) -> Any:
    """Per device (inside ``shard_map``): this device's ``ids``/``updates`` go round the ring; at each hop
    every device scatter-adds the rows it owns into its shard ``acc``. Returns the new shard."""
    n = jax.lax.axis_size(axis)
    ring = [(i, (i + 1) % n) for i in range(n)]
    base = jax.lax.axis_index(axis) * acc.shape[0]
    # dedupe once at home: the ids then stay unique on every hop (scatter_add dedupes again, cheaply)
    uniq, summed = _dedupe(ids, updates, rows_total)

    def hop(_: int, carry: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        ids_c, upd_c, out = carry
        out = scatter_add(out, ids_c - base, upd_c)
        return jax.lax.ppermute(ids_c, axis, ring), jax.lax.ppermute(upd_c, axis, ring), out

    return jax.lax.fori_loop(0, n, hop, (uniq, summed, acc))[2]


def ring_shift_scatter_add(
    table: Any,
    ids: Any,
    updates: Any,
    mesh: Any,
    axis: str,
    *,
    block: int | None = None,
    interpret: Interpret = None,
) -> Any:
    """``table.at[ids].add(updates)`` with ``table`` row-sharded and ``ids``/``updates`` sharded over
    mesh axis ``axis`` (counts divisible by its size); ids outside ``[0, rows)`` are dropped. Every
    device's ids and rows go round the ring and each owner adds them into its shard in place
    (``local_scatter_add``); the result is sharded like ``table``."""
    add = functools.partial(local_scatter_add, block=block, interpret=interpret)
    per_device = functools.partial(_ring_scatter_add, axis=axis, rows_total=table.shape[0], scatter_add=add)
    fn = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(axis, None), P(axis), P(axis, None)),
        out_specs=P(axis, None),
        check_vma=False,
    )
    return fn(table, ids, updates)


def ring_shift_lookup(
    table: Any, ids: Any, mesh: Any, axis: str, *, block: int | None = None, interpret: Interpret = None
) -> Any:
    """``table[ids]`` with ``table`` row-sharded and ``ids`` sharded over mesh axis ``axis``.

    ``table``: ``[rows, D]`` (rows divisible by the axis size), ``ids``: ``[N]`` (N divisible too).
    Returns ``[N, D]`` sharded like ``ids``; ids outside ``[0, rows)`` give zero rows. Each device keeps
    its shard; ids and partial rows travel one ``ppermute`` hop per step and every device fills in the
    rows it owns (``local_gather``); after ``n`` hops every id has met every shard and is home.
    Differentiable in ``table``: the backward sends each device's deduplicated ids and summed row
    gradients round the same ring, each device scatter-adding (``local_scatter_add``) the rows it owns
    into its shard's gradient.
    """
    n = mesh.shape[axis]
    rows_per = table.shape[0] // n
    ring = [(i, (i + 1) % n) for i in range(n)]
    gather = functools.partial(local_gather, block=block, interpret=interpret)
    scatter_add = functools.partial(local_scatter_add, block=block, interpret=interpret)

    def forward(shard: Any, my_ids: Any) -> Any:
        base = jax.lax.axis_index(axis) * rows_per

        def hop(_: int, carry: tuple[Any, Any]) -> tuple[Any, Any]:
            ids_c, acc = carry
            acc = acc + gather(shard, ids_c - base)
            return jax.lax.ppermute(ids_c, axis, ring), jax.lax.ppermute(acc, axis, ring)

        acc0 = jnp.zeros((my_ids.shape[0], shard.shape[1]), shard.dtype)
        return jax.lax.fori_loop(0, n, hop, (my_ids, acc0))[1]

    @jax.custom_vjp
    def per_device(shard: Any, my_ids: Any) -> Any:
        return forward(shard, my_ids)

    def fwd(shard: Any, my_ids: Any) -> tuple[Any, tuple[Any, Any]]:
        return forward(shard, my_ids), (my_ids, jnp.zeros_like(shard))

    def bwd(res: tuple[Any, Any], g: Any) -> tuple[Any, None]:
        my_ids, grad0 = res
        return _ring_scatter_add(
            grad0, my_ids, g, axis=axis, rows_total=table.shape[0], scatter_add=scatter_add
        ), None

    per_device.defvjp(fwd, bwd)
    fn = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(axis, None), P(axis)), out_specs=P(axis, None), check_vma=False
    )
    return fn(table, ids)
