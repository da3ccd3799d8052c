"""Cached-history serving: a user's history encoded once, any number of candidates scored against it.

The STU mask lets no history or contextual token see a candidate, and no candidate see another, so a
history token's per-layer keys and values do not depend on the candidates. `HistoryEncoder` runs the
contextual and history tokens through the layers once and returns their per-layer keys and values
(zeroed where padded: SiLU(0) = 0, so a zero key contributes exactly nothing); `CandidateScorer` runs
each candidate through the layers attending to that cache and to itself. Both share the trained
model's parameters; together they equal `DLRMv3.forward` on the full sequence (fp32, to rounding).

The attention normaliser N (`Batch.max_seq_len`: the training batch's longest sequence) is an input
of the history and travels in the cache: a server pins it per user (`serving_max_len`), since a
normaliser that grew with the candidate count would make the history depend on the candidates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from recir.transforms import ConfigError
from torch import nn

from ._batch import Batch
from ._layers import TargetAwareMask, position_ids, time_buckets, time_features, valid_tokens
from ._model import DLRMv3


@dataclass
class HistoryInputs:
    """One request's user side, dense: ids [B, L] (0 where padded), timestamps and action bitmasks
    [B, L], lengths [B], contextual ids [B, n_ctx] and the attention normaliser [B] (int64 each)."""

    uih_ids: torch.Tensor
    uih_timestamps: torch.Tensor
    uih_actions: torch.Tensor
    uih_lengths: torch.Tensor
    contextual_ids: torch.Tensor
    max_seq_len: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.uih_ids, self.uih_timestamps, self.uih_actions, self.uih_lengths, self.contextual_ids,
                self.max_seq_len)  # fmt: skip


def serving_max_len(model: DLRMv3, num_candidates: int | None = None) -> int:
    """The normaliser a server pins: the longest sequence the model was configured for (contextual
    tokens + `uih_len` + `num_candidates`), i.e. the training batches' largest `max_seq_len`.
    `num_candidates`: the count it was trained with, where the model was built for another."""
    count = model.config.num_candidates if num_candidates is None else num_candidates
    return len(model.spec.contextual) + model.config.uih_len + count


def split_batch(
    model: DLRMv3, batch: Batch, max_seq_len: int | None = None
) -> tuple[HistoryInputs, torch.Tensor]:
    """A collated `Batch` as (history inputs, candidate ids [B, C]); `max_seq_len` pins the normaliser
    (default: the batch's own, as `DLRMv3.forward` uses it)."""
    spec = model.spec
    B, L = batch.uih_timestamps.shape
    C = batch.cand_actions.shape[1]
    kjt = batch.features
    ctx = [kjt[c].values().view(B, 1) for c in spec.contextual]
    norm = batch.max_seq_len if max_seq_len is None else torch.full_like(batch.max_seq_len, max_seq_len)
    history = HistoryInputs(
        uih_ids=kjt[spec.uih_feature].values().view(B, L),
        uih_timestamps=batch.uih_timestamps,
        uih_actions=batch.uih_actions,
        uih_lengths=batch.uih_lengths,
        contextual_ids=torch.cat(ctx, dim=1) if ctx else batch.uih_lengths.new_zeros(B, 0),
        max_seq_len=norm,
    )
    return history, kjt[spec.item_feature].values().view(B, C)


def _table(model: DLRMv3, feature: str) -> torch.Tensor:
    for t in model.spec.tables:
        if feature in t.features:
            weight: torch.Tensor = model.ec.embeddings[t.name].weight
            return weight
    raise ConfigError(f"feature {feature!r} is in no table of dataset {model.spec.name!r}")


def _check_model(model: DLRMv3) -> DLRMv3:
    if not isinstance(model, DLRMv3):
        raise ConfigError(f"cached-history serving needs a recir.dlrmv3.DLRMv3, got {type(model).__name__}")
    if model.training:
        raise ConfigError(
            "cached-history serving scores with the model in training mode (dropout on). Fix: model.eval()"
        )
    return model


class HistoryEncoder(nn.Module):
    """`forward(uih_ids, uih_timestamps, uih_actions, uih_lengths, contextual_ids, max_seq_len) ->
    (keys, values [layers, B, H, n_ctx + L, A], query_time [B], max_seq_len [B])`: the cache. Layer-major,
    so each layer's keys and values are one contiguous [B * H, n_ctx + L, A] block for the scorer's
    batched products (a [B, layers, ...] cache made AOTInductor copy both per layer: 3.5 ms each at batch
    256 of the small serving model)."""

    def __init__(self, model: DLRMv3) -> None:
        super().__init__()
        self.model = _check_model(model)

    def forward(
        self,
        uih_ids: torch.Tensor,
        uih_timestamps: torch.Tensor,
        uih_actions: torch.Tensor,
        uih_lengths: torch.Tensor,
        contextual_ids: torch.Tensor,
        max_seq_len: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        m, cfg = self.model, self.model.config
        B, L = uih_ids.shape
        n_ctx = contextual_ids.shape[1]
        D = cfg.embedding_dim
        uih_e = F.embedding(uih_ids, _table(m, m.spec.uih_feature))
        # as DLRMv3.forward, on the contextual and history tokens only
        x = m.content_mlp(uih_e) + m.action_mlp(m.action_encoder(uih_actions, 0))
        ctx_e = [
            F.embedding(contextual_ids[:, j : j + 1], _table(m, f)) for j, f in enumerate(m.spec.contextual)
        ]
        ctx_t = torch.cat(ctx_e, dim=1) if ctx_e else uih_e.new_zeros(B, 0, D)
        ctx = torch.einsum("bfd,fde->bfe", ctx_t, m.contextual_weight) + m.contextual_bias
        ctx = ctx * (uih_lengths[:, None] >= m.contextual_min_uih[None, :]).to(ctx.dtype)[..., None]
        x = torch.cat([ctx, x], dim=1)
        last = torch.clamp(uih_lengths - 1, min=0)
        query_time = torch.gather(uih_timestamps, 1, last[:, None]).squeeze(1)
        ts = torch.cat([torch.zeros(B, n_ctx, dtype=torch.int64, device=x.device), uih_timestamps], dim=1)
        pos = position_ids(n_ctx, L, 0, uih_lengths, cfg.num_position_buckets)
        tb = time_buckets(query_time, ts, cfg.num_time_buckets)
        x = x * math.sqrt(D) + F.embedding(pos, m.position_emb) + F.embedding(tb, m.time_emb)
        no_candidates = torch.zeros_like(uih_lengths)
        valid = valid_tokens(n_ctx, L, uih_lengths, no_candidates, 0)
        keep = valid[:, None, :, None].to(x.dtype)  # [B, 1, T, 1]
        x = x * valid[..., None].to(x.dtype)
        mask = TargetAwareMask(valid, prefix=n_ctx + L)
        norm = max_seq_len[:, None, None, None].to(x.dtype)
        keys, values = [], []
        for i, layer in enumerate(m.layers):
            u, q, k, v = layer.project(x)
            keys.append(k * keep)
            values.append(v * keep)
            if i + 1 < len(m.layers):  # the last layer's history outputs feed nothing
                x = layer.combine(x, u, layer.attention(q, k, v, mask, norm))
        return torch.stack(keys), torch.stack(values), query_time, max_seq_len


class CandidateScorer(nn.Module):
    """`forward(keys, values, query_time, max_seq_len, cand_ids [B, C]) -> logits [B, C, tasks]`: each
    candidate through the layers against the cache (`HistoryEncoder`'s outputs) and itself."""

    def __init__(self, model: DLRMv3) -> None:
        super().__init__()
        self.model = _check_model(model)

    def forward(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        query_time: torch.Tensor,
        max_seq_len: torch.Tensor,
        cand_ids: torch.Tensor,
    ) -> torch.Tensor:
        m, cfg = self.model, self.model.config
        B, C = cand_ids.shape
        n_ctx = len(m.spec.contextual)
        cand_e = F.embedding(cand_ids, _table(m, m.spec.item_feature))
        # every candidate carries the same target-action vector: its MLP runs once, then broadcasts
        x = m.content_mlp(cand_e) + m.action_mlp(m.action_encoder.target[None, None, :])
        # every candidate sits at position n_ctx with the query time as its timestamp
        pos = position_ids(n_ctx, 0, C, query_time.new_zeros(B), cfg.num_position_buckets)[:, n_ctx:]
        tb = time_buckets(query_time, query_time[:, None].expand(B, C), cfg.num_time_buckets)
        x = x * math.sqrt(cfg.embedding_dim) + F.embedding(pos, m.position_emb) + F.embedding(tb, m.time_emb)
        norm = max_seq_len.to(x.dtype)
        for i, layer in enumerate(m.layers):
            u, q, k, v = layer.project(x)  # q, k, v [B, H, C, A]
            x = layer.combine(x, u, layer.candidate_attention(q, k, v, keys[i], values[i], norm))
        tf = time_features(query_time)[:, None, :].expand(B, C, 4).to(x.dtype)
        user = m.output_norm(m.time_combiner(torch.cat([x, tf], dim=-1)))
        result: torch.Tensor = m.head(user * m.item_tower(cand_e))
        return result
