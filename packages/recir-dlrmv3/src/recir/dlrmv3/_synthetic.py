"""Synthetic datasets: `debug` (learnable: labels follow a hidden per-user engagement rate that the
history's action bits reveal, shifted by the item's category) and `debug-random` (the reference's uniform [1, 1000) data, which nothing can learn).

Each sample is a pure function of (seed, split, index), so any data position can be replayed.
"""

from __future__ import annotations

import numpy as np

from ._batch import Sample
from ._config import DatasetSpec

NUM_CATEGORIES = 4
_T0 = 1_600_000_000
_RATES = (0.05, 0.3, 0.7, 0.95)


class SyntheticDataset:
    """A virtual list of `size` samples for one split ('train' or 'eval')."""

    def __init__(
        self,
        spec: DatasetSpec,
        *,
        seed: int,
        split: str,
        uih_len: int,
        num_candidates: int,
        num_items: int,
        size: int = 1 << 20,
    ) -> None:
        self.spec, self.seed, self.size = spec, seed, size
        self.split_id = 0 if split == "train" else 1
        self.uih_len, self.num_candidates = uih_len, num_candidates
        self.num_items = max(num_items, 2 * NUM_CATEGORIES + 1)
        self.uniform = spec.name == "debug-random"
        ranks = np.arange(1, self.num_items)
        popularity = 1.0 / (ranks + 5.0)  # Zipf-like: a few ids dominate
        self._cdf = np.cumsum(popularity) / popularity.sum()

    def __len__(self) -> int:
        return self.size

    def _popular(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self._cdf, rng.random(n)) + 1, self.num_items - 1).astype(np.int64)

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < self.size:
            raise IndexError(index)
        rng = np.random.default_rng([self.seed, self.split_id, index])
        n_ctx = len(self.spec.contextual)
        if self.uniform:
            n = int(rng.integers(1, self.uih_len + 1))
            c = int(rng.integers(1, self.num_candidates + 1))
            return Sample(
                uih_ids=rng.integers(1, 1000, n),
                uih_timestamps=np.sort(rng.integers(1, 1000, n)),
                uih_actions=rng.integers(1, 1000, n),
                cand_ids=rng.integers(1, 1000, c),
                cand_actions=rng.integers(1, 1000, c),
                contextual=rng.integers(1, 1000, n_ctx),
            )
        # Hidden rule: each user has an engagement rate; the history's bit 1 (vvp100) reveals it and
        # the candidates' labels follow it, shifted by the item's category.
        rate = float(rng.choice(_RATES))
        lo = max(1, self.uih_len // 4)
        n = int(rng.integers(lo, self.uih_len + self.uih_len // 4 + 1))
        ids = self._popular(rng, n)
        actions = (rng.random(n) < rate).astype(np.int64) | (rng.integers(0, 16, n) << 1)
        timestamps: np.ndarray = (
            _T0 + int(rng.integers(0, 10**7)) + np.cumsum(rng.exponential(3600.0, n)).astype(np.int64)
        )
        c = self.num_candidates if rng.random() < 0.8 else int(rng.integers(1, self.num_candidates + 1))
        cand = self._popular(rng, c)
        shift = np.select([cand % NUM_CATEGORIES == 0, cand % NUM_CATEGORIES == 1], [0.25, -0.25], 0.0)
        labels = rng.random(c) < np.clip(rate + shift, 0.02, 0.98)
        cand_actions = labels.astype(np.int64) | (rng.integers(0, 16, c) << 1)
        ctx = np.array([index * 7919 + self.split_id, int(rng.integers(1, 1000))])[:n_ctx]
        return Sample(ids, timestamps, actions, cand, cand_actions, ctx)
