"""``recir::hstu_attention``: HSTU's pointwise (SiLU, no softmax) attention over the target-aware causal
mask, as one opaque op with its own backward op, so every lowering can pick its kernel for it.

The mask, for query slot i and key slot j of one sample (``valid`` [B, N] marks real tokens; slots
``[0, prefix)`` are contextual and history tokens, valid as a prefix; the slots after are candidates):
i sees j iff both are valid and (``j < prefix and j < i`` or ``j == i``). So history is causal and a
candidate sees the whole valid history and itself, never another candidate. Scores
``silu(alpha * q.k) / scale``; padded query rows give exact zeros.

The backward recomputes each row block's scores from q and k instead of keeping them from the forward
(autograd would keep ``[B, H, rows, keys]`` per block and layer alive across the step): the op saves q,
k and v only. Both ops have pure-ATen references (``*_reference``, the convention the lowerings use to
inline or trace them); recir-lower-tpu registers a blocked JAX formulation and a Pallas kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._override import register_override_op

#: The override name that owns both ops (``recir.override`` on their nodes).
HSTU_ATTENTION_OVERRIDE = "recir-hstu-attention"
_silu_backward = torch.ops.aten.silu_backward.default  # (grad of silu(s), s) -> grad of s


def row_blocks(bounds: list[int], prefix: int, like: Tensor) -> list[tuple[int, int, int, Tensor]]:
    """(r0, r1, c, earlier) per query row block ``bounds[i]:bounds[i+1]``: its rows, the prefix keys it
    can see (strictly earlier slots: ``c = min(r1, prefix)``) and that causal part as a ``[rows, c]``
    0/1 mask in ``like``'s dtype."""
    out = []
    for r0, r1 in zip(bounds[:-1], bounds[1:]):
        c = min(r1, prefix)
        rows = torch.arange(r0, r1, device=like.device)[:, None]
        out.append((r0, r1, c, (torch.arange(c, device=like.device)[None, :] < rows).to(like.dtype)))
    return out


def check_hstu_attention_args(
    q: Tensor, k: Tensor, v: Tensor, valid: Tensor, prefix: int, bounds: list[int]
) -> None:
    """ValueError naming the argument when shapes, ``prefix`` or ``bounds`` do not fit."""
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"recir::hstu_attention: q, k, v must share one [B, H, N, A] shape, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, _, N, _ = q.shape
    if tuple(valid.shape) != (B, N) or valid.dtype != torch.bool:
        raise ValueError(
            f"recir::hstu_attention: valid must be bool [B, N] = [{B}, {N}], got {valid.dtype} "
            f"{tuple(valid.shape)}"
        )
    if not 0 < prefix <= N:
        raise ValueError(f"recir::hstu_attention: prefix must be in (0, N = {N}], got {prefix}")
    if (
        len(bounds) < 2
        or bounds[0] != 0
        or bounds[-1] != N
        or any(a >= b for a, b in zip(bounds, bounds[1:]))
    ):
        raise ValueError(
            f"recir::hstu_attention: bounds must rise strictly from 0 to N = {N} (query row blocks), got "
            f"{list(bounds)}. Fix: [N * i // blocks for i in range(blocks + 1)]"
        )


def hstu_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    valid: Tensor,
    scale: Tensor,
    prefix: int,
    alpha: float,
    bounds: list[int],
) -> Tensor:
    """The forward in ATen: scores only against the prefix's keys (padded keys zeroed: SiLU(0) = 0), the
    causal part per query row block from slot indices, each token's own score as a ``[B, H, N, 1]`` term,
    padded query rows zeroed. No ``[B, N, N]`` mask; a block's products cover only the keys it sees."""
    keep = valid[:, None, :, None].to(q.dtype)  # [B, 1, N, 1]
    keys = k[:, :, :prefix] * keep[:, :, :prefix]
    own = F.silu(alpha * (q * k).sum(dim=-1, keepdim=True)) / scale  # [B, H, N, 1]
    outs = []
    for r0, r1, c, earlier in row_blocks(bounds, prefix, q):
        scores = F.silu(alpha * (q[:, :, r0:r1] @ keys[:, :, :c].transpose(-1, -2))) / scale
        outs.append((scores * earlier) @ v[:, :, :c])
    attn = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return (attn + own * v) * keep


def hstu_attention_backward_reference(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    valid: Tensor,
    scale: Tensor,
    prefix: int,
    alpha: float,
    bounds: list[int],
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``hstu_attention_reference`` with the scores recomputed per row block."""
    p = prefix
    B, H, N, A = q.shape
    keep = valid[:, None, :, None].to(q.dtype)
    g = grad * keep
    # recomputed behind recir-recompute-activations' barrier, which waits for the gradient: without it a
    # compiler that merges identical computations (XLA's CSE) folds the recomputed scores back into the
    # forward's (once this reference is inlined) and keeps them alive after all (measured: XLA's
    # temporaries up, not down)
    q, keys, _ = torch.ops.recir.recompute_barrier.default([q, k[:, :, :p] * keep[:, :, :p], grad])
    dq_blocks, dkeys, dv_prefix = [], q.new_zeros(B, H, p, A), q.new_zeros(B, H, p, A)
    for r0, r1, c, earlier in row_blocks(bounds, p, q):
        q_b, g_b = q[:, :, r0:r1], g[:, :, r0:r1]
        s = alpha * (q_b @ keys[:, :, :c].transpose(-1, -2))
        weights = F.silu(s) / scale * earlier
        ds = _silu_backward((g_b @ v[:, :, :c].transpose(-1, -2)) * earlier, s) / scale
        dq_blocks.append(alpha * (ds @ keys[:, :, :c]))
        pad = (0, 0, 0, p - c)
        dkeys = dkeys + F.pad(alpha * (ds.transpose(-1, -2) @ q_b), pad)
        dv_prefix = dv_prefix + F.pad(weights.transpose(-1, -2) @ g_b, pad)
    t = alpha * (q * k).sum(dim=-1, keepdim=True)  # each token's own score
    dt = _silu_backward((g * v).sum(dim=-1, keepdim=True), t) / scale
    tail = (0, 0, 0, N - p)
    dq = torch.cat(dq_blocks, dim=2) if len(dq_blocks) > 1 else dq_blocks[0]
    dq = dq + alpha * dt * k
    dk = F.pad(dkeys * keep[:, :, :p], tail) + alpha * dt * q
    dv = F.pad(dv_prefix, tail) + F.silu(t) / scale * g
    return dq, dk, dv


@torch.library.custom_op("recir::hstu_attention", mutates_args=())
def hstu_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    valid: Tensor,
    scale: Tensor,
    prefix: int,
    alpha: float,
    bounds: list[int],
) -> Tensor:
    """HSTU attention over the target-aware mask: q, k, v [B, H, N, A], ``valid`` bool [B, N], ``scale``
    the normaliser (a 0-d tensor: the batch's longest sequence), ``prefix`` the history's end slot,
    ``alpha`` the score scale, ``bounds`` the query row blocks (``[0, ..., N]``). Returns [B, H, N, A]."""
    check_hstu_attention_args(q, k, v, valid, prefix, bounds)
    return hstu_attention_reference(q, k, v, valid, scale, prefix, alpha, bounds).contiguous()


# Outputs are contiguous whatever q's strides (q, k, v are usually transposed views): the graph's readers
# then view them as the inlined reference's contiguous results, not as q's layout.
@hstu_attention.register_fake
def _hstu_attention_fake(q, k, v, valid, scale, prefix, alpha, bounds):
    check_hstu_attention_args(q, k, v, valid, prefix, bounds)
    return q.new_empty(q.shape)


@torch.library.custom_op("recir::hstu_attention_backward", mutates_args=())
def hstu_attention_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    valid: Tensor,
    scale: Tensor,
    prefix: int,
    alpha: float,
    bounds: list[int],
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of ``recir::hstu_attention`` (its arguments after the output's gradient)."""
    dq, dk, dv = hstu_attention_backward_reference(grad, q, k, v, valid, scale, prefix, alpha, bounds)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@hstu_attention_backward.register_fake
def _hstu_attention_backward_fake(grad, q, k, v, valid, scale, prefix, alpha, bounds):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, valid, scale, prefix, alpha, bounds = inputs
    ctx.save_for_backward(q, k, v, valid, scale)
    ctx.prefix, ctx.alpha, ctx.bounds = prefix, alpha, bounds


def _backward(ctx, grad):
    q, k, v, valid, scale = ctx.saved_tensors
    dq, dk, dv = torch.ops.recir.hstu_attention_backward.default(
        grad, q, k, v, valid, scale, ctx.prefix, ctx.alpha, ctx.bounds
    )
    return dq, dk, dv, None, None, None, None, None


hstu_attention.register_autograd(_backward, setup_context=_setup_context)
register_override_op("recir::hstu_attention", HSTU_ATTENTION_OVERRIDE)
register_override_op("recir::hstu_attention_backward", HSTU_ATTENTION_OVERRIDE)
