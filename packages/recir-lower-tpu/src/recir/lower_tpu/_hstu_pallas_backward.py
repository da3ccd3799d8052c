"""The backward of HSTU's target-aware causal attention as two Pallas TPU kernels
(``hstu_attention_backward_pallas``): ``dq`` per query block, ``dk`` and ``dv`` per key block, each
recomputing its scores block by block and skipping padded history keys and padded query rows whole blocks
at a time, as the forward kernel (``_hstu_pallas.py``) does.

Sizes: the ``dq`` kernel's grid step holds its q, g and dq blocks and the whole padded k and v of its
(b, h); the ``dk``/``dv`` kernel's holds its k, v, dk and dv blocks and the whole padded q and g of its
(b, h) (double-buffered: ``4 * Np * A * itemsize`` each pair). Intermediates are ``block_q * block_k``
float32 tiles and float32 accumulators.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._hstu_pallas import _check, _jagged, _kernel_precision, _num_key_blocks
from ._ring_kernel import Interpret, _interpret

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _silu_grad(g: Any, s: Any) -> Any:
    sig = jax.nn.sigmoid(s)
    return g * sig * (1.0 + s * (1.0 - sig))


def _own(q: Any, k: Any, v: Any, g: Any, alpha: float) -> tuple[Any, Any, Any]:
    """Each row's own score's terms, float32: (t, dt) with ``t = alpha q.k`` and ``dt = silu'(t) (g.v)``,
    and ``silu(t)``."""
    q, k, v, g = (x.astype(jnp.float32) for x in (q, k, v, g))
    t = alpha * jnp.sum(q * k, axis=-1, keepdims=True)
    return t, _silu_grad(jnp.sum(g * v, axis=-1, keepdims=True), t), jax.nn.silu(t)


def _dq_kernel(hist_ref, rows_end_ref, inv_scale_ref, q_ref, g_ref, k_ref, v_ref, row_ok_ref, dq_ref, *,
               alpha: float, block_k: int, precision: Any) -> None:  # fmt: skip
    """Grid step (b, h, qi): ``dq`` of query rows ``[q0, q0 + block_q)``."""
    b, qi = pl.program_id(0), pl.program_id(2)
    block_q = q_ref.shape[0]
    q0 = qi * block_q
    hist = hist_ref[b]

    @pl.when(q0 >= rows_end_ref[b])
    def _() -> None:
        dq_ref[...] = jnp.zeros(dq_ref.shape, dq_ref.dtype)

    @pl.when(q0 < rows_end_ref[b])
    def _() -> None:
        q, g = q_ref[...], g_ref[...]
        rows = q0 + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)

        def key_block(kb: Any, acc: Any) -> Any:
            k0 = pl.multiple_of(kb * block_k, block_k)
            cols = k0 + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
            key_ok = k0 + jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0) < hist
            k = jnp.where(key_ok, k_ref[pl.ds(k0, block_k), :], 0)
            v = jnp.where(key_ok, v_ref[pl.ds(k0, block_k), :], 0)
            s = alpha * jax.lax.dot_general(
                q, k, _NT, precision=precision, preferred_element_type=jnp.float32
            )
            dw = jax.lax.dot_general(g, v, _NT, precision=precision, preferred_element_type=jnp.float32)
            ds = jnp.where((cols < hist) & (cols < rows), _silu_grad(dw, s), 0.0)
            return acc + jnp.dot(
                ds.astype(k.dtype), k, precision=precision, preferred_element_type=jnp.float32
            )

        acc = jax.lax.fori_loop(
            0, _num_key_blocks(q0 + block_q, hist, block_k), key_block, jnp.zeros(dq_ref.shape, jnp.float32)
        )
        own = pl.ds(pl.multiple_of(q0, block_q), block_q)
        k_own = k_ref[own, :]
        _, dt, _ = _own(q, k_own, v_ref[own, :], g, alpha)
        dq = alpha * inv_scale_ref[0] * (acc + dt * k_own.astype(jnp.float32))
        dq_ref[...] = jnp.where(row_ok_ref[...] != 0, dq, 0.0).astype(dq_ref.dtype)


def _dkv_kernel(hist_ref, rows_end_ref, inv_scale_ref, k_ref, v_ref, q_ref, g_ref, key_ok_ref, dk_ref, dv_ref, *,
                alpha: float, block_q: int, precision: Any) -> None:  # fmt: skip
    """Grid step (b, h, kj): ``dk`` and ``dv`` of key rows ``[k0, k0 + block_k)``: the history part from
    every later valid query row (query blocks ``[k0 // block_q, ceil(rows_end / block_q))``), then each
    row's own score."""
    b, kj = pl.program_id(0), pl.program_id(2)
    block_k = k_ref.shape[0]
    k0 = kj * block_k
    hist = hist_ref[b]
    ok = key_ok_ref[...] != 0
    k, v = jnp.where(ok, k_ref[...], 0), jnp.where(ok, v_ref[...], 0)
    cols = k0 + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)

    def query_block(qb: Any, carry: Any) -> Any:
        dk, dv = carry
        r0 = pl.multiple_of(qb * block_q, block_q)
        rows = r0 + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
        q, g = q_ref[pl.ds(r0, block_q), :], g_ref[pl.ds(r0, block_q), :]
        s = alpha * jax.lax.dot_general(q, k, _NT, precision=precision, preferred_element_type=jnp.float32)
        seen = (cols < hist) & (cols < rows)
        w = jnp.where(seen, jax.nn.silu(s), 0.0)
        dw = jax.lax.dot_general(g, v, _NT, precision=precision, preferred_element_type=jnp.float32)
        ds = jnp.where(seen, _silu_grad(dw, s), 0.0)
        dv = dv + jax.lax.dot_general(w.astype(g.dtype), g, _TN, precision=precision, preferred_element_type=jnp.float32)  # fmt: skip
        dk = dk + jax.lax.dot_general(ds.astype(q.dtype), q, _TN, precision=precision, preferred_element_type=jnp.float32)  # fmt: skip
        return dk, dv

    zeros = jnp.zeros(dk_ref.shape, jnp.float32)
    # queries i > j >= k0 that are valid: rows below rows_end; none when the block is past the history
    first = k0 // block_q
    last = jnp.where(k0 < hist, (rows_end_ref[b] + block_q - 1) // block_q, first)
    dk, dv = jax.lax.fori_loop(first, jnp.maximum(last, first), query_block, (zeros, zeros))
    own = pl.ds(pl.multiple_of(k0, block_k), block_k)
    q_own, g_own = q_ref[own, :], g_ref[own, :]
    _, dt, silu_t = _own(q_own, k_ref[...], v_ref[...], g_own, alpha)
    inv_scale = inv_scale_ref[0]
    dk = inv_scale * (alpha * jnp.where(ok, dk, 0.0) + alpha * dt * q_own.astype(jnp.float32))
    dv = inv_scale * (dv + silu_t * g_own.astype(jnp.float32))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def hstu_attention_backward_pallas(
    grad: jax.Array,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    valid: jax.Array,
    scale: jax.Array,
    prefix: int,
    alpha: float,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    interpret: Interpret = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) of ``hstu_attention_pallas`` (and of ``recir::hstu_attention``) for the output gradient
    ``grad``; the same arguments and blocks as the forward. Rows that are not valid get zero gradients."""
    _check(q, k, v, valid, prefix)
    batch, heads, n, dim = q.shape
    # padded slots may hold anything (NaN included): zeros there, so no product of theirs reaches a valid row
    keep = valid.astype(bool)[:, None, :, None]
    zeroed = (jnp.where(keep, x, 0).astype(q.dtype) for x in (q, k, v, grad))
    (bq, bk, n_pad), (hist, rows_end, row_ok, inv_scale), (q, k, v, g) = _jagged(
        valid, scale, prefix, block_q, block_k, *zeroed
    )
    precision = _kernel_precision(q.dtype)
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))
    whole = pl.BlockSpec((None, None, n_pad, dim), lambda b, h, i, *_: (b, h, 0, 0))

    def rows_spec(block: int) -> Any:
        return pl.BlockSpec((None, None, block, dim), lambda b, h, i, *_: (b, h, i, 0))

    def mask_spec(block: int) -> Any:
        return pl.BlockSpec((None, block, 1), lambda b, h, i, *_: (b, i, 0))

    def grid(block: int, in_specs: list[Any], out_specs: Any) -> Any:
        return pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, heads, n_pad // block),
            in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), *in_specs],
            out_specs=out_specs,
        )

    shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, alpha=float(alpha), block_k=bk, precision=precision),
        grid_spec=grid(bq, [rows_spec(bq), rows_spec(bq), whole, whole, mask_spec(bq)], rows_spec(bq)),
        out_shape=shape,
        compiler_params=params,
        interpret=_interpret(interpret),
    )(hist, rows_end, inv_scale, q, g, k, v, row_ok)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, alpha=float(alpha), block_q=bq, precision=precision),
        grid_spec=grid(
            bk, [rows_spec(bk), rows_spec(bk), whole, whole, mask_spec(bk)], [rows_spec(bk), rows_spec(bk)]
        ),
        out_shape=[shape, shape],
        compiler_params=params,
        interpret=_interpret(interpret),
    )(hist, rows_end, inv_scale, k, v, q, g, row_ok)
    return dq[:, :, :n], dk[:, :, :n], dv[:, :, :n]
