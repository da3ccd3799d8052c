"""The Triton kernels of :mod:`recir.lower_gpu._hstu_triton` (imported only when they are used: importing
this module imports Triton, and Triton decides here, at definition, whether ``TRITON_INTERPRET=1`` makes
them interpreted)."""

# ruff: noqa: N803  (Triton's pointer arguments are capitalised; no `from __future__ import annotations`: Triton reads tl.constexpr annotations)

import triton
import triton.language as tl


@triton.jit
def _scores(q, k, s_alpha, inv_scale, offs_m, offs_n, prefix, IEEE: tl.constexpr):
    """(silu(alpha q k^T) / scale masked, alpha q k^T, the mask) of one [rows, keys] tile."""
    s = s_alpha * tl.dot(q, tl.trans(k), input_precision="ieee" if IEEE else None)
    seen = (offs_n[None, :] < offs_m[:, None]) & (offs_n[None, :] < prefix)
    w = tl.where(seen, s * tl.sigmoid(s) * inv_scale, 0.0)
    return w, s, seen


@triton.jit
def _score_grads(g, v, s, seen, inv_scale, IEEE: tl.constexpr):
    """The gradient with respect to the tile's scores ``s = alpha q k^T``: ``(g v^T) silu'(s) / scale`` where
    the mask lets a key be seen, else 0 (``alpha`` times it, times k or q, is the gradient of q or k)."""
    sig = tl.sigmoid(s)
    dw = tl.dot(g, tl.trans(v), input_precision="ieee" if IEEE else None)
    return tl.where(seen, dw * sig * (1.0 + s * (1.0 - sig)) * inv_scale, 0.0)


@triton.jit
def _tile(P, base, offs, limit, offs_a, A: tl.constexpr):
    """The ``[len(offs), BLOCK_A]`` rows ``offs`` of one (sample, head)'s ``[N, A]`` slab at ``P + base``,
    zeros at rows ``>= limit`` and columns ``>= A``."""
    return tl.load(P + base + offs[:, None] * A + offs_a[None, :], mask=(offs[:, None] < limit) & (offs_a[None, :] < A), other=0.0)  # fmt: skip


@triton.jit
def _put(P, base, offs, limit, offs_a, A: tl.constexpr, x):
    """Store ``x`` at the rows ``offs`` (``< limit``) of ``P + base``'s slab, in ``P``'s dtype."""
    tl.store(P + base + offs[:, None] * A + offs_a[None, :], x.to(P.dtype.element_ty), mask=(offs[:, None] < limit) & (offs_a[None, :] < A))  # fmt: skip


@triton.jit
def _program(S, s_stride, L, bh, H: tl.constexpr, N: tl.constexpr, A: tl.constexpr):
    """(the slab's offset, 1 / scale, the sample's valid history slots) of the (sample, head) ``bh``."""
    base = bh.to(tl.int64) * N * A
    inv_scale = 1.0 / tl.load(S + (bh // H) * s_stride).to(tl.float32)
    return base, inv_scale, tl.load(L + bh // H)


@triton.jit
def forward(Q, K, V, Out, S, s_stride, L, H: tl.constexpr, N: tl.constexpr, prefix: tl.constexpr, A: tl.constexpr, alpha,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    bh, pid_m = tl.program_id(0), tl.program_id(1)  # (sample, head) on the axis of 2^31 programs
    base, inv_scale, hist = _program(S, s_stride, L, bh, H, N, A)
    offs_m, offs_a = pid_m * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_A)
    q = _tile(Q, base, offs_m, N, offs_a, A)
    acc = tl.zeros([BLOCK_M, BLOCK_A], dtype=tl.float32)
    live = (pid_m * BLOCK_M < hist) | ((pid_m + 1) * BLOCK_M > prefix)  # not only padded history rows
    # every history block, those at or past the query block's last row or the sample's history skipped
    # (a loop bound read from program_id is what Triton's interpreter cannot take)
    for n0 in range(0, prefix, BLOCK_N):
        if live & (n0 < (pid_m + 1) * BLOCK_M) & (n0 < hist):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            v = _tile(V, base, offs_n, prefix, offs_a, A)
            w, _, _ = _scores(q, _tile(K, base, offs_n, prefix, offs_a, A), alpha, inv_scale, offs_m, offs_n, prefix, IEEE)  # fmt: skip
            acc += tl.dot(w.to(v.dtype), v, input_precision="ieee" if IEEE else None)
    _put(Out, base, offs_m, N, offs_a, A, acc)


@triton.jit
def backward_q(Q, K, V, G, DQ, S, s_stride, L, H: tl.constexpr, N: tl.constexpr, prefix: tl.constexpr, A: tl.constexpr, alpha,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    bh, pid_m = tl.program_id(0), tl.program_id(1)
    base, inv_scale, hist = _program(S, s_stride, L, bh, H, N, A)
    offs_m, offs_a = pid_m * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_A)
    q, g = _tile(Q, base, offs_m, N, offs_a, A), _tile(G, base, offs_m, N, offs_a, A)
    dq = tl.zeros([BLOCK_M, BLOCK_A], dtype=tl.float32)
    live = (pid_m * BLOCK_M < hist) | ((pid_m + 1) * BLOCK_M > prefix)
    for n0 in range(0, prefix, BLOCK_N):  # the forward's blocks
        if live & (n0 < (pid_m + 1) * BLOCK_M) & (n0 < hist):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k, v = _tile(K, base, offs_n, prefix, offs_a, A), _tile(V, base, offs_n, prefix, offs_a, A)
            _, s, seen = _scores(q, k, alpha, inv_scale, offs_m, offs_n, prefix, IEEE)
            ds = _score_grads(g, v, s, seen, inv_scale, IEEE)
            dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee" if IEEE else None)
    _put(DQ, base, offs_m, N, offs_a, A, alpha * dq)


@triton.jit
def backward_kv(Q, K, V, G, DK, DV, S, s_stride, L, H: tl.constexpr, N: tl.constexpr, prefix: tl.constexpr, A: tl.constexpr, alpha,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    bh, pid_n = tl.program_id(0), tl.program_id(1)
    base, inv_scale, hist = _program(S, s_stride, L, bh, H, N, A)
    offs_n, offs_a = pid_n * BLOCK_N + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_A)
    k, v = _tile(K, base, offs_n, prefix, offs_a, A), _tile(V, base, offs_n, prefix, offs_a, A)
    dk = tl.zeros([BLOCK_N, BLOCK_A], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_A], dtype=tl.float32)
    # only queries after the block's first key see it (j < i), none if the block is past the history,
    # none from a block of padded history rows
    for m0 in range(0, N, BLOCK_M):
        live = (m0 < hist) | (m0 + BLOCK_M > prefix)
        if live & (m0 + BLOCK_M > pid_n * BLOCK_N + 1) & (pid_n * BLOCK_N < hist):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            q, g = _tile(Q, base, offs_m, N, offs_a, A), _tile(G, base, offs_m, N, offs_a, A)
            w, s, seen = _scores(q, k, alpha, inv_scale, offs_m, offs_n, prefix, IEEE)
            dv += tl.dot(tl.trans(w).to(g.dtype), g, input_precision="ieee" if IEEE else None)
            ds = _score_grads(g, v, s, seen, inv_scale, IEEE)
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision="ieee" if IEEE else None)
    _put(DK, base, offs_n, prefix, offs_a, A, alpha * dk)
    _put(DV, base, offs_n, prefix, offs_a, A, dv)
