"""DLRMv3 building blocks on static padded shapes: SwishLayerNorm, MLPs, the target-aware causal
mask, position/time buckets, the STU layer and the hour/day time features.

Everything is pure tensor maths on `[B, N, ...]` tensors with lengths as tensors, so make_fx can trace
it in fake mode (no `.item()`, no data-dependent Python branches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from recir.transforms import candidate_attention, hstu_attention, hstu_attention_reference
from torch import nn


class _Take(torch.autograd.Function):
    """`x[indices]` (advanced indexing) for indices that name distinct elements: its backward writes the
    gradient into zeros (`index_put`) instead of accumulating it (`index_put(accumulate=True)`, which a
    compiler must assume may collide and so emits as atomic adds)."""

    @staticmethod
    def forward(x: torch.Tensor, *indices: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x[indices]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*inputs[1:])
        ctx.shape = inputs[0].shape

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        indices = ctx.saved_tensors
        out = grad.new_zeros(ctx.shape).index_put(indices, grad)
        return (out, *([None] * len(indices)))


def take(x: torch.Tensor, *indices: torch.Tensor) -> torch.Tensor:
    """`x[indices]` for indices naming distinct elements (see `_Take`)."""
    return _Take.apply(x, *indices)  # type: ignore[no-any-return]


class SwishLayerNorm(nn.Module):
    """x * sigmoid(LayerNorm(x))."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.norm(x))


def mlp(d_in: int, hidden: int, d_out: int) -> nn.Sequential:
    """Linear -> SwishLayerNorm -> Linear -> LayerNorm (content, action and item MLPs)."""
    return nn.Sequential(
        nn.Linear(d_in, hidden), SwishLayerNorm(hidden), nn.Linear(hidden, d_out), nn.LayerNorm(d_out)
    )


def token_order(num_contextual: int, uih_len: int, num_candidates: int) -> torch.Tensor:
    """Causal order id of each padded slot: contextual j -> j, UIH i -> C+i, every candidate -> C+L
    (candidates share one id, so none sees another)."""
    c, n = num_contextual, num_contextual + uih_len + num_candidates
    order = torch.arange(n)
    return torch.clamp(order, max=c + uih_len)


def valid_tokens(
    num_contextual: int, uih_len: int, uih_lengths: torch.Tensor, num_candidates: torch.Tensor, max_cand: int
) -> torch.Tensor:
    """[B, N] bool: contextual tokens, the first `uih_lengths` UIH slots, the first `num_candidates`."""
    B = uih_lengths.shape[0]
    ctx = torch.ones(B, num_contextual, dtype=torch.bool, device=uih_lengths.device)
    uih = torch.arange(uih_len, device=uih_lengths.device)[None, :] < uih_lengths[:, None]
    cand = torch.arange(max_cand, device=uih_lengths.device)[None, :] < num_candidates[:, None]
    return torch.cat([ctx, uih, cand], dim=1)


def attention_mask(valid: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool, query x key: a token sees itself and tokens of strictly smaller order id;
    padded tokens are never seen (and see nothing)."""
    n = order.shape[0]
    order = order.to(valid.device)
    causal = (order[None, :] < order[:, None]) | torch.eye(n, dtype=torch.bool, device=valid.device)
    return causal[None] & valid[:, :, None] & valid[:, None, :]


@dataclass(frozen=True)
class TargetAwareMask:
    """`attention_mask(valid, order)` in factored form, for the order `token_order` builds: slots
    `[0, prefix)` (contextual and history) see strictly earlier slots, every later slot (a candidate)
    sees the whole prefix, each token sees itself, padded tokens (`valid` [B, N] False) see and are seen
    by nothing. `STULayer.attention` computes with it without a `[B, N, N]` mask (recir.transforms'
    `hstu_attention`): scores only against the prefix's keys, the causal part from slot indices, each
    token's own score apart. The contextual and
    history slots must be valid as a prefix of `[0, prefix)` (as `valid_tokens` makes them)."""

    valid: torch.Tensor
    prefix: int

    def dense(self) -> torch.Tensor:
        """The same mask as `[B, N, N]` bool (`attention_mask`)."""
        n = self.valid.shape[1]
        return attention_mask(self.valid, token_order(0, self.prefix, n - self.prefix))


def position_ids(num_contextual: int, uih_len: int, num_candidates: int, uih_lengths: torch.Tensor,
                 num_buckets: int) -> torch.Tensor:  # fmt: skip
    """[B, N] positions: contextual j -> j; UIH slot i -> C + (len - i) (distance from the end of
    the history); every candidate -> C. Clamped to the table."""
    c = num_contextual
    B = uih_lengths.shape[0]
    i = torch.arange(uih_len, device=uih_lengths.device)[None, :]
    uih = c + torch.clamp(uih_lengths[:, None] - i, min=0)
    ctx = torch.arange(c, device=uih_lengths.device)[None, :].expand(B, c)
    cand = torch.full((B, num_candidates), c, dtype=uih.dtype, device=uih.device)
    return torch.clamp(torch.cat([ctx, uih, cand], dim=1), max=num_buckets - 1)


def time_buckets(query_time: torch.Tensor, timestamps: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """int(sqrt(max(t_query - t, 1e-6) / 60)) clamped to [0, num_buckets]; deltas in int64 first so
    float32 never sees absolute epoch seconds."""
    delta = (query_time[:, None] - timestamps).to(torch.float32)
    b = torch.sqrt(torch.clamp(delta, min=1e-6) / 60.0).to(torch.int64)
    return torch.clamp(b, min=0, max=num_buckets)


def time_features(timestamps: torch.Tensor) -> torch.Tensor:
    """[..., 4]: cos/sin of the hour of day and of the day of week (timestamps in epoch seconds)."""
    feats = []
    for period, units in ((3600, 24), (86400, 7)):
        elapsed = torch.remainder(torch.div(timestamps, period, rounding_mode="floor"), units)
        angle = elapsed.to(torch.float32) / units * (2 * math.pi)
        feats += [torch.cos(angle), torch.sin(angle)]
    return torch.stack(feats, dim=-1)


def _head_slots(index: torch.Tensor, N: int, H: int) -> tuple[torch.Tensor, ...]:
    """(sample, head, slot) indices of packed rows `index` [T] (slots of a flattened [B, N] layout) for
    each of H heads, shaped to broadcast to [T, H]."""
    return (index // N)[:, None], torch.arange(H, device=index.device)[None, :], (index % N)[:, None]


def _to_heads(rows: torch.Tensor, at: tuple[torch.Tensor, ...], B: int, N: int, H: int) -> torch.Tensor:
    """Packed rows [T, H * A] scattered to [B, H, N, A] at `_head_slots` (zeros in the other slots)."""
    A = rows.shape[-1] // H
    return rows.new_zeros(B, H, N, A).index_put(at, rows.reshape(-1, H, A))


class STULayer(nn.Module):
    """One HSTU layer: pointwise SiLU attention over the target-aware causal mask, no softmax."""

    #: Sequences at least this long (padded slots) split their queries into two row blocks (see attention).
    BLOCKED_FROM = 512

    def __init__(
        self, dim: int, num_heads: int, head_dim: int, dropout: float, attention_blocks: int | None = None
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.dropout = num_heads, head_dim, dropout
        if attention_blocks is not None and attention_blocks < 1:
            raise ValueError(
                f"STULayer: attention_blocks must be >= 1 or None (automatic), got {attention_blocks}"
            )
        self.attention_blocks = attention_blocks
        self.input_norm = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * num_heads * head_dim)
        self.attn_norm = nn.LayerNorm(num_heads * head_dim)
        self.output = nn.Linear(3 * num_heads * head_dim, dim, bias=False)
        self.alpha = 1.0 / math.sqrt(head_dim)
        #: The attention over a `TargetAwareMask` is the `recir::hstu_attention` op, whose backward
        #: recomputes its scores instead of keeping them from the forward (`--recompute attention`).
        self.recompute_scores = False

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | TargetAwareMask,
        max_len: torch.Tensor,
        packed: tuple[torch.Tensor, tuple[int, int]] | None = None,
        candidates_only: bool = False,
    ) -> torch.Tensor:
        """x [B, N, D], mask: a `TargetAwareMask` or [B, N, N] bool and causal (no query sees a later
        slot, as `attention_mask` builds it), max_len: 0-d tensor (the batch's longest sequence).
        `packed` = (index, (B, N)): x holds packed rows, see `forward_packed` (called through here, so
        module hooks and capture's module scopes see the layer). `candidates_only`: the candidate slots'
        output only ([B, C, D], `forward_candidates`; the mask must be a `TargetAwareMask`)."""
        if candidates_only:
            if not isinstance(mask, TargetAwareMask):
                raise TypeError(
                    f"STULayer: candidates_only needs a TargetAwareMask (the prefix it names), got "
                    f"{type(mask).__name__}. Fix: pass TargetAwareMask(valid, prefix), not its dense form"
                )
            return self.forward_candidates(x, mask, max_len, packed)
        if packed is not None:
            return self.forward_packed(x, packed[0], packed[1], mask, max_len)
        u, q, k, v = self.project(x)
        return self.combine(x, u, self.attention(q, k, v, mask, max_len))

    def forward_candidates(
        self,
        x: torch.Tensor,
        mask: TargetAwareMask,
        max_len: torch.Tensor,
        packed: tuple[torch.Tensor, tuple[int, int]] | None = None,
    ) -> torch.Tensor:
        """The layer's output on the candidate slots only (`mask.prefix` onward): [B, C, D].

        For a last layer whose other rows feed nothing. Every slot's keys and values are computed (the
        candidates attend to the whole prefix), queries, `u`, the attention, its norm and the output
        projection only for the candidate rows: a candidate sees the valid prefix and itself, so its row
        equals `forward`'s (up to summation order) with about C / N of the query-side work. x as
        `forward` takes it: [B, N, D], or packed rows with `packed` = (index, (B, N)). Run through
        `layer(..., candidates_only=True)` so module hooks and scopes see the layer."""
        H, A, p = self.num_heads, self.head_dim, mask.prefix
        weight, bias = self.uvqk.weight, self.uvqk.bias  # rows: u, v, q, k (H * A each)

        def part(t: torch.Tensor, i: int) -> torch.Tensor:
            return F.linear(t, weight[i * H * A : (i + 1) * H * A], bias[i * H * A : (i + 1) * H * A])

        normed = self.input_norm(x)
        if packed is None:
            B, N, D = x.shape
            v, k = (part(normed, i).view(B, N, H, A).transpose(1, 2) for i in (1, 3))
            x_c, normed_c = x[:, p:], normed[:, p:]
        else:
            index, (B, N) = packed
            D = x.shape[-1]
            at = _head_slots(index, N, H)
            v, k = (_to_heads(part(normed, i), at, B, N, H) for i in (1, 3))
            x_c = x.new_zeros(B * N, D).index_copy(0, index, x).view(B, N, D)[:, p:]
            normed_c = self.input_norm(x_c)  # row-wise: the candidate rows' norm
        C = x_c.shape[1]
        u = F.silu(part(normed_c, 0))
        q = part(normed_c, 2).view(B, C, H, A).transpose(1, 2)
        keep = mask.valid[:, None, :, None].to(q.dtype)  # [B, 1, N, 1]
        attn = self.candidate_attention(
            q, k[:, :, p:], v[:, :, p:], k[:, :, :p] * keep[:, :, :p], v[:, :, :p], max_len.to(q.dtype)
        )
        return self.combine(x_c, u, attn * keep[:, :, p:])

    def candidate_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        prefix_keys: torch.Tensor,
        prefix_values: torch.Tensor,
        scale: torch.Tensor,
    ) -> torch.Tensor:
        """Candidates' attention: each candidate (q, k, v [B, H, C, A]) against the prefix's keys and
        values ([B, H, P, A], padded keys zeroed: SiLU(0) = 0) and itself, none against another;
        `scale` the normaliser, 0-d or one per sample [B]. Returns [B, H, C, A]."""
        scale = scale.reshape(-1, 1, 1, 1) if scale.dim() else scale
        return candidate_attention(q, k, v, prefix_keys, prefix_values, scale, self.alpha)

    def forward_packed(
        self,
        x: torch.Tensor,
        index: torch.Tensor,
        shape: tuple[int, int],
        mask: torch.Tensor | TargetAwareMask,
        max_len: torch.Tensor,
    ) -> torch.Tensor:
        """The layer on packed rows: x [T, D] holds the slots `index` [T] (sorted, distinct; every real
        token among them, `Batch.token_index`) of the flattened `[B, N]` layout, `shape` = (B, N). The
        per-token work (norms, projections, the output) runs on the T rows; q, k and v are scattered
        to `[B, H, N, A]` (zeros in the other slots, which the mask hides) for the attention only, and
        its output gathered back. Real rows equal `forward`'s up to summation order."""
        B, N = shape
        H, A = self.num_heads, self.head_dim
        uvqk = self.uvqk(self.input_norm(x))
        u = F.silu(uvqk[:, : H * A])
        # (sample, head, slot) of each row and head: q, k, v go straight to [B, H, N, A] and the
        # attention output comes back from it in runs of A contiguous elements (no transposes).
        at = _head_slots(index, N, H)
        v, q, k = (_to_heads(t, at, B, N, H) for t in uvqk[:, H * A :].split(H * A, dim=-1))
        attn = take(self.attention(q, k, v, mask, max_len), *at)
        return self._residual(x, u, attn.reshape(-1, H * A))

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | TargetAwareMask,
        max_len: torch.Tensor,
    ) -> torch.Tensor:
        """silu(alpha q k^T) / max_len, masked, times v: [B, H, N, A].

        The mask is causal, so a block of query rows needs only the keys up to its last row: with
        `attention_blocks` row blocks the products and the score tensors cover about (b + 1) / 2b of the
        dense N x N (3/4 with two). The keys left out are masked to exact zeros, so the values are the
        dense formulation's up to summation order. Automatic (None): two blocks from `BLOCKED_FROM`
        slots (full-size layer at UIH 1024, batch 4, fwd + bwd under Inductor on a 2-core CPU: 753 ms
        dense, 492 with two blocks, 611 with four; at UIH 256 two blocks gain nothing), else dense.

        A `TargetAwareMask` (what `DLRMv3.forward` passes) is applied without building `[B, N, N]`:
        scores against the prefix's keys only (candidates' keys are seen by their own token alone),
        padded keys zeroed (SiLU(0) = 0), the causal part `key < query` from slot indices, each token's
        own score added as a `[B, H, N]` term, padded query rows zeroed at the end. Equal to the dense
        mask's values up to summation order, with fewer products and no mask loads (UIH 128 with 64
        candidates, serving: the score tensor is 2/3 of N x N): `recir.transforms.hstu_attention_reference`
        traced inline. With `recompute_scores` it is the `recir::hstu_attention` op instead (one opaque
        node, its backward op recomputing the scores rather than keeping them), which each lowering
        implements: Inductor on its reference, a blocked JAX formulation or a Pallas kernel on the TPU
        path."""
        n = q.shape[2]
        blocks = self.attention_blocks or (2 if n >= self.BLOCKED_FROM else 1)
        scale = max_len.to(q.dtype)
        bounds = [n * i // blocks for i in range(blocks + 1)]
        if isinstance(mask, TargetAwareMask):
            args = (q, k, v, mask.valid, scale, mask.prefix, self.alpha, bounds)
            if self.recompute_scores:
                return hstu_attention(*args)  # type: ignore[no-any-return]
            return hstu_attention_reference(*args)
        if blocks == 1:
            scores = F.silu(self.alpha * (q @ k.transpose(-1, -2))) / scale
            return (scores * mask[:, None].to(q.dtype)) @ v
        outs = []
        for r0, r1 in zip(bounds[:-1], bounds[1:]):
            scores = F.silu(self.alpha * (q[:, :, r0:r1] @ k[:, :, :r1].transpose(-1, -2))) / scale
            outs.append((scores * mask[:, None, r0:r1, :r1].to(q.dtype)) @ v[:, :, :r1])
        return torch.cat(outs, dim=2)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, N, D] -> u [B, N, H*A] (after SiLU) and q, k, v [B, H, N, A]."""
        B, N, _ = x.shape
        H, A = self.num_heads, self.head_dim
        u, v, q, k = self.uvqk(self.input_norm(x)).split(H * A, dim=-1)
        u = F.silu(u)
        q, k, v = (t.view(B, N, H, A).transpose(1, 2) for t in (q, k, v))
        return u, q, k, v

    def combine(self, x: torch.Tensor, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input x [B, N, D], u and the attention output attn [B, H, N, A]."""
        B, N, _ = x.shape
        return self._residual(x, u, attn.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim))

    def _residual(self, x: torch.Tensor, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x + W_out dropout(concat[u, attn, u * LN(attn)]), on any leading shape."""
        y = u * self.attn_norm(attn)
        out = torch.cat([u, attn, y], dim=-1)
        return x + self.output(F.dropout(out, self.dropout, self.training))
