"""The one batch format every path shares: per-sample jagged lists in, static padded tensors out.

`Sample` is one user request (jagged numpy arrays); `collate` pads/truncates a list of them to a
`Batch` whose every tensor has a static shape (UIH padded to `uih_len`, candidates to
`num_candidates`, padding id 0) and carries the true lengths as tensors, plus the per-sample loss
normaliser that makes a data-parallel slice's loss its share of the global batch's loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
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
    which scales the attention."""

    features: KeyedJaggedTensor
    uih_lengths: torch.Tensor  # [B] int64, <= uih_len
    num_candidates: torch.Tensor  # [B] int64, <= num_candidates
    uih_timestamps: torch.Tensor  # [B, L] int64 seconds (0 where padded)
    uih_actions: torch.Tensor  # [B, L] int64 action bitmasks
    cand_actions: torch.Tensor  # [B, C] int64 action bitmasks (the labels)
    loss_norm: torch.Tensor  # [B] float32, the same value for every sample (see above)
    max_seq_len: torch.Tensor  # [B] int64, the same value for every sample (see above)

    @property
    def batch_size(self) -> int:
        return int(self.uih_lengths.shape[0])

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
        L, C = batch.uih_timestamps.shape[1], batch.cand_actions.shape[1]
        self.real += int(batch.uih_lengths.sum() + batch.num_candidates.sum())
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


def collate(
    samples: Sequence[Sample],
    spec: DatasetSpec,
    uih_len: int,
    num_candidates: int,
    rows: dict[str, int] | None = None,
    global_samples: Sequence[Sample] | None = None,
) -> Batch:
    """Pads `samples` to static shapes: the most recent `uih_len` UIH events, the first
    `num_candidates` candidates; with `rows` (feature -> table rows) ids are hashed into
    [1, rows) so that they never collide with the padding id 0. `global_samples`: the global batch
    that `samples` is a data-parallel slice of (default `samples`): its candidate count normalises the
    loss and its longest sequence the attention (`Batch.loss_norm`, `Batch.max_seq_len`)."""
    B = len(samples)
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
    )
