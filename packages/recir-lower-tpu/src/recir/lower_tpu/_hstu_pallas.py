"""HSTU's target-aware causal attention forward as a Pallas TPU kernel that skips padded history keys
(``hstu_attention_pallas``), and the dense ``[B, N, N]``-mask formulation it must equal.

Sizes: grid ``(B, H, Np // block_q)`` with ``Np`` = N padded to a multiple of both block sizes. A grid
step holds its q and output blocks (double-buffered: ``4 * block_q * A * itemsize``) and the whole padded
k and v of its (b, h) (double-buffered: ``4 * Np * A * itemsize``; 8 MiB at Np 4096, A 128, f32), fetched
once per (b, h) since their block index does not change with the query block; the key loop streams
``[block_k, A]`` slices of them, so intermediates are ``block_q * block_k`` f32 scores and a
``block_q * A`` f32 accumulator. Per-sample history lengths and last valid rows sit in SMEM.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._ring_kernel import Interpret, _interpret

DEFAULT_BLOCK = 128  # query / key slots per block; a multiple of 8 (TPU sublanes)


def _block(name: str, block: int | None, n: int) -> int:
    """``block`` (default 128), or ``n`` rounded up to 8 when that is smaller."""
    block = DEFAULT_BLOCK if block is None else block
    if block <= 0 or block % 8:
        raise ValueError(
            f"hstu attention {name} must be a positive multiple of 8 (TPU sublanes), got {block}"
        )
    return min(block, -(-n // 8) * 8)


def _kernel_precision(dtype: Any) -> jax.lax.Precision:
    """The in-kernel products' precision. Mosaic compiles DEFAULT (one bf16 pass) or HIGHEST (float32) and
    raises NotImplementedError for anything between (jax 0.10.2), so float32 operands run HIGHEST unless
    JAX's ``default_matmul_precision`` (TPUOptions.matmul_precision, traced around the step) asks for one
    pass; bf16 operands are one pass either way."""
    one_pass = (None, "default", "bfloat16", "fastest")
    if jnp.dtype(dtype) != jnp.float32 or jax.config.jax_default_matmul_precision in one_pass:
        return jax.lax.Precision.DEFAULT
    return jax.lax.Precision.HIGHEST


def _num_key_blocks(q_end: Any, hist: Any, block_k: int) -> Any:
    """Key blocks a query block ending at ``q_end`` reads: those holding a key ``j < min(q_end, L_b)``."""
    return (jnp.minimum(q_end, hist) + block_k - 1) // block_k


def _hstu_kernel(
    hist_ref: Any,
    rows_end_ref: Any,
    inv_scale_ref: Any,
    q_ref: Any,
    k_ref: Any,
    v_ref: Any,
    row_ok_ref: Any,
    out_ref: Any,
    *,
    alpha: float,
    block_k: int,
    precision: jax.lax.Precision,
) -> None:
    """Grid step (b, h, qi): query rows ``[q0, q0 + block_q)`` against history keys ``j < min(i, L_b)``
    (key blocks past ``min(q0 + block_q, L_b)`` are never touched), plus each row's own key."""
    b, qi = pl.program_id(0), pl.program_id(2)
    block_q = q_ref.shape[0]
    q0 = qi * block_q
    hist = hist_ref[b]

    @pl.when(q0 >= rows_end_ref[b])
    def _() -> None:
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    @pl.when(q0 < rows_end_ref[b])
    def _() -> None:
        q = q_ref[...]
        rows = q0 + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
        dims = (((1,), (1,)), ((), ()))

        def key_block(kb: Any, acc: Any) -> Any:
            k0 = pl.multiple_of(kb * block_k, block_k)
            cols = k0 + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
            s = alpha * jax.lax.dot_general(
                q, k_ref[pl.ds(k0, block_k), :], dims, precision=precision, preferred_element_type=jnp.float32
            )
            # where, not a product: padded keys may hold anything (NaN included)
            p = jnp.where((cols < hist) & (cols < rows), jax.nn.silu(s), 0.0)
            key_ok = k0 + jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0) < hist
            v = jnp.where(key_ok, v_ref[pl.ds(k0, block_k), :], 0)
            return acc + jnp.dot(
                p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32
            )

        # j < prefix and j < i, with j < L_b <= prefix: only the key blocks below min(q0 + block_q, L_b)
        num_kb = _num_key_blocks(q0 + block_q, hist, block_k)
        acc = jax.lax.fori_loop(0, num_kb, key_block, jnp.zeros(out_ref.shape, jnp.float32))
        # j == i, for history and candidates alike
        k_own = k_ref[pl.ds(pl.multiple_of(q0, block_q), block_q), :].astype(jnp.float32)
        v_own = v_ref[pl.ds(pl.multiple_of(q0, block_q), block_q), :].astype(jnp.float32)
        s_own = alpha * jnp.sum(q.astype(jnp.float32) * k_own, axis=-1, keepdims=True)
        acc = acc + jax.nn.silu(s_own) * v_own
        out = jnp.where(row_ok_ref[...] != 0, acc * inv_scale_ref[0], 0.0)
        out_ref[...] = out.astype(out_ref.dtype)


def _check(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array, prefix: int) -> None:
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"hstu attention q, k, v must all be [B, H, N, A], got {q.shape}, {k.shape}, {v.shape}; "
            "fix: reshape them to one [B, H, N, A] shape"
        )
    if valid.shape != (q.shape[0], q.shape[2]):
        raise ValueError(
            f"hstu attention valid must be [B, N] = {(q.shape[0], q.shape[2])}, got {valid.shape}"
        )
    if not 0 < prefix <= q.shape[2]:
        raise ValueError(
            f"hstu attention prefix must satisfy 0 < prefix <= N = {q.shape[2]}, got {prefix}; "
            "fix: pass the number of contextual + history slots"
        )


def _jagged(
    valid: jax.Array, scale: Any, prefix: int, block_q: int | None, block_k: int | None, *xs: jax.Array
) -> tuple[tuple[int, int, int], tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """What the kernels (forward and backward) share: ((block_q, block_k, N padded to both blocks), (each
    sample's valid history slots ``[B]``, one past its last valid row ``[B]``, the padded rows' validity
    ``[B, Np, 1]`` int32, ``[1 / scale]``), ``xs`` ``[B, H, N, A]`` padded to ``Np`` rows)."""
    n = xs[0].shape[2]
    bq, bk = _block("block_q", block_q, n), _block("block_k", block_k, n)
    pad = (-n) % math.lcm(bq, bk)
    valid = valid.astype(bool)
    hist = jnp.sum(valid[:, :prefix], axis=1, dtype=jnp.int32)
    rows_end = jnp.max(jnp.where(valid, jnp.arange(1, n + 1, dtype=jnp.int32), 0), axis=1)
    row_ok = jnp.pad(valid, ((0, 0), (0, pad))).astype(jnp.int32)[:, :, None]
    inv_scale = jnp.reshape(1.0 / jnp.asarray(scale, jnp.float32), (1,))
    padded = tuple(jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in xs)
    return (bq, bk, n + pad), (hist, rows_end, row_ok, inv_scale), padded


def hstu_attention_pallas(
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
) -> jax.Array:
    """HSTU target-aware causal attention forward; equals ``hstu_attention_dense``.

    ``q, k, v``: ``[B, H, N, A]``; ``valid``: bool ``[B, N]``, a prefix of ``[0, prefix)`` (the history)
    and any pattern over the candidates ``[prefix, N)``; ``scale``: 0-d normaliser (may be traced). Row i
    sees history keys ``j < i`` and itself; padded keys are skipped whole blocks at a time, invalid rows
    are 0. Returns ``[B, H, N, A]`` in ``q.dtype``; accumulates in float32.
    """
    _check(q, k, v, valid, prefix)
    batch, heads, n, dim = q.shape
    (bq, bk, n_pad), (hist, rows_end, row_ok, inv_scale), (q, k, v) = _jagged(
        valid, scale, prefix, block_q, block_k, q, k, v
    )

    q_spec = pl.BlockSpec((None, None, bq, dim), lambda b, h, i, *_: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, n_pad, dim), lambda b, h, i, *_: (b, h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, heads, n_pad // bq),
        in_specs=[
            pl.BlockSpec(memory_space=pltpu.SMEM),
            q_spec,
            kv_spec,
            kv_spec,
            pl.BlockSpec((None, bq, 1), lambda b, h, i, *_: (b, i, 0)),
        ],
        out_specs=q_spec,
    )
    out = pl.pallas_call(
        functools.partial(_hstu_kernel, alpha=float(alpha), block_k=bk, precision=_kernel_precision(q.dtype)),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=_interpret(interpret),
    )(hist, rows_end, inv_scale, q, k, v, row_ok)
    return out[:, :, :n]


def hstu_attention_dense(
    q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array, scale: jax.Array, prefix: int, alpha: float
) -> jax.Array:
    """The reference: ``allowed(i, j) = valid_i & valid_j & ((j < prefix & j < i) | j == i)`` as a dense
    ``[B, N, N]`` mask; masked entries (and invalid k/v rows, NaN included) are dropped by ``where``."""
    n = q.shape[2]
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    allowed = valid[:, :, None] & valid[:, None, :] & (((j < prefix) & (j < i)) | (j == i))[None]
    key_ok = valid[:, None, :, None]
    k, v = (jnp.where(key_ok, x, 0).astype(jnp.float32) for x in (k, v))
    s = alpha * jnp.einsum("bhid,bhjd->bhij", q.astype(jnp.float32), k, precision="highest")
    p = jnp.where(allowed[:, None], jax.nn.silu(s), 0.0) / scale
    out = jnp.einsum("bhij,bhjd->bhid", p, v, precision="highest")
    return out.astype(q.dtype)
