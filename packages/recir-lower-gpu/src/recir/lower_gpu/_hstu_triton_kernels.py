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
def forward(Q, K, V, Out, S, s_stride, L, H: tl.constexpr, N: tl.constexpr, prefix: tl.constexpr, A: tl.constexpr, alpha,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    bh, pid_m = tl.program_id(0), tl.program_id(1)  # (sample, head) on the axis of 2^31 programs
    base = bh.to(tl.int64) * N * A
    inv_scale = 1.0 / tl.load(S + (bh // H) * s_stride).to(tl.float32)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_a = tl.arange(0, BLOCK_A)
    rows = (offs_m[:, None] < N) & (offs_a[None, :] < A)
    q = tl.load(Q + base + offs_m[:, None] * A + offs_a[None, :], mask=rows, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_A], dtype=tl.float32)
    hist = tl.load(L + bh // H)  # the sample's valid history slots (valid is a prefix there)
    live = (pid_m * BLOCK_M < hist) | ((pid_m + 1) * BLOCK_M > prefix)  # not only padded history rows
    # every history block, those at or past the query block's last row or the sample's history skipped
    # (a loop bound read from program_id is what Triton's interpreter cannot take)
    for n0 in range(0, prefix, BLOCK_N):
        if live & (n0 < (pid_m + 1) * BLOCK_M) & (n0 < hist):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            keys = (offs_n[:, None] < prefix) & (offs_a[None, :] < A)
            k = tl.load(K + base + offs_n[:, None] * A + offs_a[None, :], mask=keys, other=0.0)
            v = tl.load(V + base + offs_n[:, None] * A + offs_a[None, :], mask=keys, other=0.0)
            w, _, _ = _scores(q, k, alpha, inv_scale, offs_m, offs_n, prefix, IEEE)
            acc += tl.dot(w.to(v.dtype), v, input_precision="ieee" if IEEE else None)
    tl.store(Out + base + offs_m[:, None] * A + offs_a[None, :], acc.to(Out.dtype.element_ty), mask=rows)


@triton.jit
def backward_q(Q, K, V, G, DQ, S, s_stride, L, H: tl.constexpr, N: tl.constexpr, prefix: tl.constexpr, A: tl.constexpr, alpha,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    bh, pid_m = tl.program_id(0), tl.program_id(1)  # (sample, head) on the axis of 2^31 programs
    base = bh.to(tl.int64) * N * A
    inv_scale = 1.0 / tl.load(S + (bh // H) * s_stride).to(tl.float32)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_a = tl.arange(0, BLOCK_A)
    rows = (offs_m[:, None] < N) & (offs_a[None, :] < A)
    q = tl.load(Q + base + offs_m[:, None] * A + offs_a[None, :], mask=rows, other=0.0)
    g = tl.load(G + base + offs_m[:, None] * A + offs_a[None, :], mask=rows, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_A], dtype=tl.float32)
    hist = tl.load(L + bh // H)  # the sample's valid history slots (valid is a prefix there)
    live = (pid_m * BLOCK_M < hist) | ((pid_m + 1) * BLOCK_M > prefix)  # not only padded history rows
    # every history block, those at or past the query block's last row or the sample's history skipped
    # (a loop bound read from program_id is what Triton's interpreter cannot take)
    for n0 in range(0, prefix, BLOCK_N):
        if live & (n0 < (pid_m + 1) * BLOCK_M) & (n0 < hist):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            keys = (offs_n[:, None] < prefix) & (offs_a[None, :] < A)
            k = tl.load(K + base + offs_n[:, None] * A + offs_a[None, :], mask=keys, other=0.0)
            v = tl.load(V + base + offs_n[:, None] * A + offs_a[None, :], mask=keys, other=0.0)
            _, s, seen = _scores(q, k, alpha, inv_scale, offs_m, offs_n, prefix, IEEE)
            sig = tl.sigmoid(s)
            dw = tl.dot(g, tl.trans(v), input_precision="ieee" if IEEE else None)
            ds = tl.where(seen, dw * sig * (1.0 + s * (1.0 - sig)) * inv_scale, 0.0)
            dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee" if IEEE else None)
    tl.store(
        DQ + base + offs_m[:, None] * A + offs_a[None, :], (alpha * dq).to(DQ.dtype.element_ty), mask=rows
    )


@triton.jit
def backward_kv(Q, K, V, G, DK, DV, S, s_stride, L, H: tl.constexpr, N: tl.constexpr, prefix: tl.constexpr, A: tl.constexpr, alpha,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    bh, pid_n = tl.program_id(0), tl.program_id(1)  # (sample, head) on the axis of 2^31 programs
    base = bh.to(tl.int64) * N * A
    inv_scale = 1.0 / tl.load(S + (bh // H) * s_stride).to(tl.float32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_a = tl.arange(0, BLOCK_A)
    keys = (offs_n[:, None] < prefix) & (offs_a[None, :] < A)
    k = tl.load(K + base + offs_n[:, None] * A + offs_a[None, :], mask=keys, other=0.0)
    v = tl.load(V + base + offs_n[:, None] * A + offs_a[None, :], mask=keys, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_A], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_A], dtype=tl.float32)
    hist = tl.load(L + bh // H)  # the sample's valid history slots (valid is a prefix there)
    # only queries after the block's first key see it (j < i), none if the block is past the history,
    # none from a block of padded history rows
    for m0 in range(0, N, BLOCK_M):
        live = (m0 < hist) | (m0 + BLOCK_M > prefix)
        if live & (m0 + BLOCK_M > pid_n * BLOCK_N + 1) & (pid_n * BLOCK_N < hist):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            rows = (offs_m[:, None] < N) & (offs_a[None, :] < A)
            q = tl.load(Q + base + offs_m[:, None] * A + offs_a[None, :], mask=rows, other=0.0)
            g = tl.load(G + base + offs_m[:, None] * A + offs_a[None, :], mask=rows, other=0.0)
            w, s, seen = _scores(q, k, alpha, inv_scale, offs_m, offs_n, prefix, IEEE)
            sig = tl.sigmoid(s)
            dv += tl.dot(tl.trans(w).to(g.dtype), g, input_precision="ieee" if IEEE else None)
            dw = tl.dot(g, tl.trans(v), input_precision="ieee" if IEEE else None)
            ds = tl.where(seen, dw * sig * (1.0 + s * (1.0 - sig)) * inv_scale, 0.0)
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision="ieee" if IEEE else None)
    tl.store(
        DK + base + offs_n[:, None] * A + offs_a[None, :], (alpha * dk).to(DK.dtype.element_ty), mask=keys
    )
    tl.store(DV + base + offs_n[:, None] * A + offs_a[None, :], dv.to(DV.dtype.element_ty), mask=keys)
