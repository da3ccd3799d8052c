"""The one batch format every path shares: per-sample jagged lists in, static padded tensors out.

`Sample` is one user request (jagged numpy arrays); `collate` pads/truncates a list of them to a
`Batch` whose every tensor has a static shape (UIH padded to `uih_len`, candidates to
`num_candidates`, padding id 0) and carries the true lengths as tensors, plus the per-sample loss
normaliser that makes a data-parallel slice's loss its share of the global batch's loss.

A token budget packs the batch: `Batch.token_index` then lists fewer rows than the padded layout has
slots (every real token plus as many padded slots as the budget leaves), and the model runs its
per-token layers on those rows only (see `DLRMv3.forward`). A batch with more real tokens than its
budget first loses the oldest UIH events of its longest histories (`fit_token_budget`), the same kind
of truncation that `uih_len` already applies to each history.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ._config import DatasetSpec

PADDING_ID = 0


@dataclass
class Sample:
    """One user request, jagged: its UIH (time-sorted) and its candidates."""

    uih_ids: np.ndarray
    uih_timestamps: np.ndarray
    uih_actions: np.ndarray
    cand_ids: np.ndarray
    cand_actions: np.ndarray
    contextual: np.ndarray


@dataclass
class Batch:
    """Static-shaped batch. `features` is a KJT whose keys are `DatasetSpec.features`; every UIH key
    has `uih_len` values per sample, the candidate key `num_candidates`, contextual keys 1 each.

    Two fields describe the GLOBAL batch that this one may be a data-parallel slice of, so that D even
    slices' averaged gradients equal the global batch's gradient however lengths fall between them:
    `loss_norm[i]` is (real candidates of the global batch) / (global batch size), so `loss_norm.sum()`
    is the global count on the whole batch and its 1/D share on a slice (the loss divides by it);
    `max_seq_len[i]` is the global batch's longest token sequence (contextual + UIH + candidates),
    which scales the attention.

    `token_index` [T] (sorted, distinct) names the slots of the flattened `[B, N]` token layout
    (N = contextual + `uih_len` + `num_candidates`) that the per-token layers compute: every slot
    (T = B * N, unpacked) without a token budget, else every real token plus the first padded slots
    up to the budget."""

    features: KeyedJaggedTensor
    uih_lengths: torch.Tensor  # [B] int64, <= uih_len
    num_candidates: torch.Tensor  # [B] int64, <= num_candidates
    uih_timestamps: torch.Tensor  # [B, L] int64 seconds (0 where padded)
    uih_actions: torch.Tensor  # [B, L] int64 action bitmasks
    cand_actions: torch.Tensor  # [B, C] int64 action bitmasks (the labels)
    loss_norm: torch.Tensor  # [B] float32, the same value for every sample (see above)
    max_seq_len: torch.Tensor  # [B] int64, the same value for every sample (see above)
    token_index: torch.Tensor  # [T] int64 slots the per-token layers compute (see above)

    @property
    def batch_size(self) -> int:
        return int(self.uih_lengths.shape[0])

    @property
    def num_slots(self) -> int:
        """B * N: the padded layout's token slots (contextual + UIH + candidates per sample)."""
        n_ctx = len(self.features.keys()) - 2
        return self.batch_size * (n_ctx + self.uih_timestamps.shape[1] + self.cand_actions.shape[1])

    @property
    def packed(self) -> bool:
        """Whether the per-token layers compute fewer rows than the padded layout has slots."""
        return int(self.token_index.shape[0]) < self.num_slots

    def to(self, device: torch.device | str) -> Batch:
        return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, self)


_DENSE = [f.name for f in fields(Batch) if f.name != "features"]


def _flatten_with_keys(b: Batch) -> tuple[list[tuple[Any, torch.Tensor]], tuple[Any, ...]]:
    # The KJT flattens to its two tensors (values, lengths); keys, stride and per-key sizes (all
    # static here) ride in the context, so every leaf is a tensor and the rebuilt KJT never needs
    # .tolist() to split its values (which make_fx could not trace).
    kjt = b.features
    leaves = [
        (pytree.GetAttrKey("features_values"), kjt.values()),
        (pytree.GetAttrKey("features_lengths"), kjt.lengths()),
    ]
    leaves += [(pytree.GetAttrKey(n), getattr(b, n)) for n in _DENSE]
    return leaves, (tuple(kjt.keys()), kjt.stride(), tuple(kjt.length_per_key()))


def _unflatten(values: Any, context: tuple[Any, ...]) -> Batch:
    values = list(values)
    keys, stride, per_key = context
    kjt = KeyedJaggedTensor(
        keys=list(keys), values=values[0], lengths=values[1], stride=stride, length_per_key=list(per_key)
    )
    return Batch(kjt, *values[2:])


pytree.register_pytree_node(
    Batch,
    lambda b: ([t for _, t in _flatten_with_keys(b)[0]], _flatten_with_keys(b)[1]),
    _unflatten,
    flatten_with_keys_fn=_flatten_with_keys,
    serialized_type_name="recir.dlrmv3.Batch",
)


@dataclass
class PaddingStats:
    """Real versus padded token counts of the batches collated so far."""

    real: int = 0
    padded: int = 0

    def add(self, batch: Batch) -> None:
        """Counts UIH and candidate tokens: real ones, and the rows computed for them (slots, or a
        packed batch's rows less its contextual tokens)."""
        L, C = batch.uih_timestamps.shape[1], batch.cand_actions.shape[1]
        self.real += int(batch.uih_lengths.sum() + batch.num_candidates.sum())
        if batch.packed:
            n_ctx = batch.num_slots // batch.batch_size - L - C
            self.padded += int(batch.token_index.shape[0]) - batch.batch_size * n_ctx
        else:
            self.padded += batch.batch_size * (L + C)

    @property
    def waste(self) -> float:
        return 0.0 if self.padded == 0 else 1.0 - self.real / self.padded


def _fit(values: np.ndarray, size: int, keep_last: bool) -> tuple[np.ndarray, int]:
    values = np.asarray(values, dtype=np.int64).reshape(-1)
    if values.shape[0] > size:
        values = values[-size:] if keep_last else values[:size]
    n = int(values.shape[0])
    out: np.ndarray = np.full(size, PADDING_ID, dtype=np.int64)
    out[:n] = values
    return out, n


def _global_norms(
    samples: Sequence[Sample], n_ctx: int, uih_len: int, num_candidates: int
) -> tuple[float, int]:
    """(`loss_norm`, `max_seq_len`) of the global batch `samples`: its real candidates after truncation
    (at least 1) per sample, and its longest sequence after truncation."""
    cands = [min(int(np.asarray(s.cand_ids).size), num_candidates) for s in samples]
    uihs = [min(int(np.asarray(s.uih_ids).size), uih_len) for s in samples]
    longest = max((u + c for u, c in zip(uihs, cands)), default=0)
    return max(sum(cands), 1) / max(len(samples), 1), n_ctx + longest


def _real_tokens(s: Sample, uih_len: int, num_candidates: int) -> tuple[int, int]:
    """(UIH events, candidates) of `s` after `uih_len` / `num_candidates` truncation."""
    return min(int(np.asarray(s.uih_ids).size), uih_len), min(
        int(np.asarray(s.cand_ids).size), num_candidates
    )


def real_tokens(samples: Sequence[Sample], n_ctx: int, uih_len: int, num_candidates: int) -> int:
    """The real tokens (contextual, UIH events, candidates after truncation) of `samples` together."""
    return sum(n_ctx + sum(_real_tokens(s, uih_len, num_candidates)) for s in samples)


def fit_token_budget(
    samples: Sequence[Sample], n_ctx: int, uih_len: int, num_candidates: int, budget: int
) -> tuple[list[Sample], int]:
    """`samples` with at most `budget` real tokens (contextual + UIH + candidates), and how many UIH
    events were dropped: while over budget, the longest histories lose their oldest events (one cap on
    every history, the budget's rest spread one event each over the longest). Raises ValueError when
    the contextual tokens and candidates alone exceed the budget."""
    counts = [_real_tokens(s, uih_len, num_candidates) for s in samples]
    uih = np.array([u for u, _ in counts], dtype=np.int64)
    room = budget - sum(n_ctx + c for _, c in counts)
    if room < 0:
        raise ValueError(
            f"token budget {budget} is below the batch's contextual tokens and candidates "
            f"({budget - room}); raise it to at least {len(samples)} * (contextual + num_candidates)"
        )
    if int(uih.sum()) <= room:
        return list(samples), 0
    lo, hi = 0, int(uih.max())  # the largest cap with sum(min(uih, cap)) <= room
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if int(np.minimum(uih, mid).sum()) <= room else (lo, mid - 1)
    caps = np.minimum(uih, lo)
    spare = room - int(caps.sum())
    for i in np.flatnonzero(uih > lo)[:spare]:
        caps[i] += 1
    out = []
    for s, keep in zip(samples, caps):
        n = int(np.asarray(s.uih_ids).size)
        k = n - int(keep)  # keep the newest `keep` events
        out.append(
            replace(
                s,
                uih_ids=np.asarray(s.uih_ids)[k:],
                uih_timestamps=np.asarray(s.uih_timestamps)[k:],
                uih_actions=np.asarray(s.uih_actions)[k:],
            )
        )
    return out, int(uih.sum() - caps.sum())


def estimate_token_budget(
    samples: Sequence[Sample], n_ctx: int, uih_len: int, num_candidates: int, batch_size: int
) -> int:
    """A token budget for batches of `batch_size` drawn like `samples`: the per-batch real-token mean
    plus two standard deviations (independent samples), rounded up to a multiple of 8 and at most the
    padded layout's slots; about 2% of batches then exceed it and are trimmed (`fit_token_budget`)."""
    real = np.array([n_ctx + sum(_real_tokens(s, uih_len, num_candidates)) for s in samples], np.float64)
    if real.size == 0:
        raise ValueError("estimate_token_budget needs at least one sample")
    budget = batch_size * float(real.mean()) + 2.0 * math.sqrt(batch_size) * float(real.std())
    return min(int(math.ceil(budget / 8.0)) * 8, batch_size * (n_ctx + uih_len + num_candidates))


def collate(
    samples: Sequence[Sample],
    spec: DatasetSpec,
    uih_len: int,
    num_candidates: int,
    rows: dict[str, int] | None = None,
    global_samples: Sequence[Sample] | None = None,
    token_budget: int | None = None,
) -> Batch:
    """Pads `samples` to static shapes: the most recent `uih_len` UIH events, the first
    `num_candidates` candidates; with `rows` (feature -> table rows) ids are hashed into
    [1, rows) so that they never collide with the padding id 0. `global_samples`: the global batch
    that `samples` is a data-parallel slice of (default `samples`): its candidate count normalises the
    loss and its longest sequence the attention (`Batch.loss_norm`, `Batch.max_seq_len`).
    `token_budget`: pack the batch into at most that many token rows (`Batch.token_index`), first
    trimming it with `fit_token_budget` (a data-parallel caller trims `global_samples` slice by slice
    beforehand, so that its norms describe the trimmed batch)."""
    B = len(samples)
    n_ctx = len(spec.contextual)
    slots = B * (n_ctx + uih_len + num_candidates)
    if token_budget is not None:
        samples, _ = fit_token_budget(samples, n_ctx, uih_len, num_candidates, token_budget)
    everyone = samples if global_samples is None else global_samples
    norm, longest = _global_norms(everyone, len(spec.contextual), uih_len, num_candidates)
    uih: np.ndarray = np.zeros((B, uih_len), np.int64)
    ts: np.ndarray = np.zeros((B, uih_len), np.int64)
    act: np.ndarray = np.zeros((B, uih_len), np.int64)
    cand: np.ndarray = np.zeros((B, num_candidates), np.int64)
    cact: np.ndarray = np.zeros((B, num_candidates), np.int64)
    ctx: np.ndarray = np.zeros((B, len(spec.contextual)), np.int64)
    lengths: np.ndarray = np.zeros(B, np.int64)
    ncand: np.ndarray = np.zeros(B, np.int64)
    for i, s in enumerate(samples):
        uih[i], lengths[i] = _fit(s.uih_ids, uih_len, keep_last=True)
        ts[i], _ = _fit(s.uih_timestamps, uih_len, keep_last=True)
        act[i], _ = _fit(s.uih_actions, uih_len, keep_last=True)
        cand[i], ncand[i] = _fit(s.cand_ids, num_candidates, keep_last=False)
        cact[i], _ = _fit(s.cand_actions, num_candidates, keep_last=False)
        ctx[i] = np.asarray(s.contextual, np.int64).reshape(-1)[: len(spec.contextual)]
    if rows is not None:
        # ids live in [1, rows): 0 is the padding row; real ids are hashed into the rest.
        def _hash(a: np.ndarray, n: int) -> np.ndarray:
            return np.where(a > 0, (a - 1) % max(n - 1, 1) + 1, 0)

        uih = _hash(uih, rows[spec.uih_feature])
        cand = _hash(cand, rows[spec.item_feature])
        for j, name in enumerate(spec.contextual):
            ctx[:, j] = ctx[:, j] % max(rows[name] - 1, 1) + 1  # contextual 0 is a real value
    uih_mask = np.arange(uih_len)[None, :] < lengths[:, None]
    cand_mask = np.arange(num_candidates)[None, :] < ncand[:, None]
    valid = np.concatenate([np.ones((B, n_ctx), bool), uih_mask, cand_mask], axis=1).reshape(-1)
    packed_rows = slots if token_budget is None else min(token_budget, slots)
    real = np.flatnonzero(valid)
    token_index = np.sort(np.concatenate([real, np.flatnonzero(~valid)[: packed_rows - real.size]]))
    uih, ts, act = uih * uih_mask, ts * uih_mask, act * uih_mask
    cand, cact = cand * cand_mask, cact * cand_mask
    values = np.concatenate([uih.reshape(-1), cand.reshape(-1), ctx.T.reshape(-1)])
    kjt_lengths = np.concatenate(
        [np.full(B, uih_len), np.full(B, num_candidates), np.ones(B * len(spec.contextual))]
    ).astype(np.int64)
    features = KeyedJaggedTensor(
        keys=list(spec.features),
        values=torch.from_numpy(values),
        lengths=torch.from_numpy(kjt_lengths),
        stride=B,
        length_per_key=[B * uih_len, B * num_candidates] + [B] * len(spec.contextual),
    )
    return Batch(
        features=features,
        uih_lengths=torch.from_numpy(lengths),
        num_candidates=torch.from_numpy(ncand),
        uih_timestamps=torch.from_numpy(ts),
        uih_actions=torch.from_numpy(act),
        cand_actions=torch.from_numpy(cact),
        loss_norm=torch.full((B,), norm, dtype=torch.float32),
        max_seq_len=torch.full((B,), longest, dtype=torch.int64),
        token_index=torch.from_numpy(token_index.astype(np.int64)),
    )
