"""The DLRMv3 (HSTU ranking) model: TorchRec EmbeddingCollection over a static-shaped KJT, item
tower, contextual preprocessor with action encoder, positional/time encodings, STU stack,
timestamp postprocessor, multitask head and the reference's BCE loss.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig

from ._batch import Batch
from ._config import DatasetSpec, ModelConfig
from ._layers import (
    STULayer,
    SwishLayerNorm,
    TargetAwareMask,
    mlp,
    position_ids,
    take,
    time_buckets,
    time_features,
    valid_tokens,
)

TASK_LOSS_WEIGHT = 0.2


class ActionEncoder(nn.Module):
    """Each set bit of an action bitmask adds a learned vector (concatenated over the action weights);
    candidates get one learned 'target action' vector."""

    def __init__(self, action_weights: tuple[int, ...], dim: int) -> None:
        super().__init__()
        self.register_buffer("weights", torch.tensor(action_weights, dtype=torch.int64), persistent=False)
        self.table = nn.Parameter(torch.empty(len(action_weights), dim).normal_(0, 0.1))
        self.target = nn.Parameter(torch.empty(len(action_weights) * dim).normal_(0, 0.1))

    @property
    def output_dim(self) -> int:
        return self.table.numel()

    def forward(self, uih_actions: torch.Tensor, num_candidates: int) -> torch.Tensor:
        B, L = uih_actions.shape
        bits = torch.bitwise_and(uih_actions[..., None], self.weights) > 0  # [B, L, A]
        uih = (bits[..., None].to(self.table.dtype) * self.table).reshape(B, L, -1)
        cand = self.target.expand(B, num_candidates, -1)
        return torch.cat([uih, cand], dim=1)


class DLRMv3(nn.Module):
    """DLRMv3 over a `Batch`; `forward(batch) -> logits [B, num_candidates, num_tasks]`."""

    #: The STU layers take the factored `TargetAwareMask` (scores against the history's keys only, no
    #: `[B, N, N]` mask) when the candidate slots are at least this share of the sequence, which is the
    #: share of the N x N products it saves; below it, the dense mask. Measured on a 2-core AVX2 CPU,
    #: full-size training step, fp32: 10 candidates at UIH 64 (13%) GPU path 855 -> 860 ms, TPU path
    #: 816 -> 732; at UIH 256 (3.7%) GPU path 2821 -> 2936, TPU path 3258 -> 3517 (one run each, noisy);
    #: serving at UIH 128 with 64 candidates (33%): one layer's compiled attention 227 -> 146 ms at batch 256.
    #: Always the factored mask when the layers recompute their scores (`recompute_attention_scores`).
    FACTORED_MASK_FROM = 0.125

    def __init__(self, spec: DatasetSpec, config: ModelConfig) -> None:
        super().__init__()
        self.spec, self.config = spec, config
        D, hidden = config.embedding_dim, config.hidden_dim
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name=t.name,
                    embedding_dim=D,
                    num_embeddings=config.table_rows(t),
                    feature_names=list(t.features),
                )
                for t in spec.tables
            ],
            device=torch.device("cpu"),
        )
        self.item_tower = mlp(D, D, D)
        self.content_mlp = mlp(D, hidden, D)
        self.action_encoder = ActionEncoder(spec.action_weights, config.action_embedding_dim)
        self.action_mlp = mlp(self.action_encoder.output_dim, hidden, D)
        n_ctx = len(spec.contextual)
        self.contextual_weight = nn.Parameter(torch.empty(n_ctx, D, D).uniform_(-1 / D**0.5, 1 / D**0.5))
        self.contextual_bias = nn.Parameter(torch.zeros(n_ctx, D))
        self.register_buffer(
            "contextual_min_uih",
            torch.tensor([spec.contextual_min_uih.get(c, 0) for c in spec.contextual], dtype=torch.int64),
            persistent=False,
        )
        nb, nt = config.num_position_buckets, config.num_time_buckets
        self.position_emb = nn.Parameter(torch.empty(nb, D).uniform_(-((1 / nb) ** 0.5), (1 / nb) ** 0.5))
        self.time_emb = nn.Parameter(torch.empty(nt + 1, D).uniform_(-((1 / nt) ** 0.5), (1 / nt) ** 0.5))
        self.layers = nn.ModuleList(
            STULayer(D, config.num_heads, config.head_dim, config.layer_dropout)
            for _ in range(config.num_layers)
        )
        self.time_combiner = nn.Linear(D + 4, D)
        self.output_norm = nn.LayerNorm(D)
        self.head = nn.Sequential(nn.Linear(D, D), SwishLayerNorm(D), nn.Linear(D, len(spec.tasks)))
        self.register_buffer(
            "task_weights", torch.tensor([t.weight for t in spec.tasks], dtype=torch.int64), persistent=False
        )

    #: The last STU layer computes its query side for the candidates' rows alone (the only rows the
    #: postprocessor reads). False: it runs the whole sequence like the others, every layer's attention
    #: then one op over the whole sequence, as `recir.transforms.cached_history` splits it (its
    #: `recir-cleanup-narrow` then trims the last layer's history rows itself).
    candidates_only_last_layer = True

    def recompute_attention_scores(self, on: bool = True) -> DLRMv3:
        """Each STU layer's attention backward recomputes its scores from q and k instead of keeping the
        `[B, H, rows, keys]` products from the forward (`--recompute attention`): one more product per
        row block in the backward for less memory at long sequences. Values equal up to rounding."""
        for layer in self.layers:
            layer.recompute_scores = on
        return self

    def embed(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """UIH [B, L, D], candidate [B, C, D] and contextual [B, n_ctx, D] id embeddings."""
        B, L = batch.uih_timestamps.shape
        C = batch.cand_actions.shape[1]
        D = self.config.embedding_dim
        out = self.ec(batch.features)
        uih = out[self.spec.uih_feature].values().view(B, L, D)
        cand = out[self.spec.item_feature].values().view(B, C, D)
        ctx = [out[c].values().view(B, 1, D) for c in self.spec.contextual]
        ctx_t = torch.cat(ctx, dim=1) if ctx else uih.new_zeros(B, 0, D)
        return uih, cand, ctx_t

    def forward(self, batch: Batch) -> torch.Tensor:
        cfg = self.config
        uih_e, cand_e, ctx_e = self.embed(batch)
        B, L, D = uih_e.shape
        C, n_ctx = cand_e.shape[1], ctx_e.shape[1]
        lengths, ncand = batch.uih_lengths, batch.num_candidates

        # Preprocessor: content MLP + action encoder on UIH and candidate tokens.
        tokens = torch.cat([uih_e, cand_e], dim=1)
        x = self.content_mlp(tokens) + self.action_mlp(self.action_encoder(batch.uih_actions, C))
        # Contextual tokens: one Linear per feature, zeroed below the feature's minimum UIH length.
        ctx = torch.einsum("bfd,fde->bfe", ctx_e, self.contextual_weight) + self.contextual_bias
        ctx = ctx * (lengths[:, None] >= self.contextual_min_uih[None, :]).to(ctx.dtype)[..., None]
        x = torch.cat([ctx, x], dim=1)  # [B, N, D]

        # Positional and time encodings; candidate query time = the latest UIH time.
        last = torch.clamp(lengths - 1, min=0)
        query_time = torch.gather(batch.uih_timestamps, 1, last[:, None]).squeeze(1)
        ts = torch.cat(
            [
                torch.zeros(B, n_ctx, dtype=torch.int64, device=x.device),
                batch.uih_timestamps,
                query_time[:, None].expand(B, C),
            ],
            dim=1,
        )
        pos = position_ids(n_ctx, L, C, lengths, cfg.num_position_buckets)
        tb = time_buckets(query_time, ts, cfg.num_time_buckets)
        x = x * math.sqrt(D) + F.embedding(pos, self.position_emb) + F.embedding(tb, self.time_emb)

        valid = valid_tokens(n_ctx, L, lengths, ncand, C)
        x = F.dropout(x, cfg.input_dropout, self.training) * valid[..., None].to(x.dtype)
        target_mask = TargetAwareMask(valid, prefix=n_ctx + L)
        mask: torch.Tensor | TargetAwareMask = target_mask
        if self.FACTORED_MASK_FROM * x.shape[1] > C and not any(
            layer.recompute_scores for layer in self.layers
        ):
            mask = mask.dense()
        max_len = batch.max_seq_len.max()  # the global batch's longest sequence (see Batch)
        # Only the candidates' rows of the last layer's output are read (the postprocessor below), so the
        # last layer computes its query side for those rows alone (STULayer.forward_candidates).
        *layers, last = (
            self.layers if len(self.layers) and self.candidates_only_last_layer else (*self.layers, None)
        )
        if batch.packed:  # per-token work on the batch's token rows only (Batch.token_index)
            index, N = batch.token_index, x.shape[1]
            packed = (index, (B, N))
            rows = take(x.reshape(B * N, D), index)
            for layer in layers:
                rows = layer(rows, mask, max_len, packed=packed)
            if last is None:
                user = rows.new_zeros(B * N, D).index_copy(0, index, rows).view(B, N, D)[:, n_ctx + L :]
            else:
                user = last(rows, target_mask, max_len, packed=packed, candidates_only=True)
        else:
            for layer in layers:
                x = layer(x, mask, max_len)
            user = x[:, n_ctx + L :] if last is None else last(x, target_mask, max_len, candidates_only=True)

        # Postprocessor on candidates: hour/day cos/sin -> Linear -> LN.
        tf = time_features(query_time)[:, None, :].expand(B, C, 4).to(user.dtype)
        user = self.output_norm(self.time_combiner(torch.cat([user, tf], dim=-1)))
        item = self.item_tower(cand_e)
        return self.head(user * item)

    def labels(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Labels [B, C, T] float and candidate weights [B, C] float (0 for padded candidates)."""
        labels = (torch.bitwise_and(batch.cand_actions[..., None], self.task_weights) > 0).float()
        C = batch.cand_actions.shape[1]
        weights = torch.arange(C, device=labels.device)[None, :] < batch.num_candidates[:, None]
        return labels, weights.float()


def multitask_loss(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, norm: torch.Tensor | None = None
) -> torch.Tensor:
    """Per task: BCE-with-logits summed over real candidates, divided by their count, times 0.2; summed
    over tasks. `norm` (a batch's `loss_norm`) replaces the count by its sum: the global batch's count
    on the whole batch, its share on a data-parallel slice (so the ranks' mean is the global loss)."""
    bce = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
    w = weights[..., None].to(logits.dtype)
    # collate keeps every loss_norm sum positive (at least 1 over the data-parallel size)
    count = torch.clamp(w.sum(dim=(0, 1)), min=1.0) if norm is None else norm.to(logits.dtype).sum()
    per_task = (bce * w).sum(dim=(0, 1)) / count
    return (per_task * TASK_LOSS_WEIGHT).sum()


def loss_fn(model: DLRMv3, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The train-step loss for capture: `(loss, logits)`, normalised by `batch.loss_norm`."""
    logits = model(batch)
    labels, weights = model.labels(batch)
    return multitask_loss(logits, labels, weights, batch.loss_norm), logits
