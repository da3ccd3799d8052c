"""Datasets by name and the batch stream. Batch `i` of a run is a pure function of (dataset, seed,
i), so a data position is just the global step and a resumed run sees the same batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from recir.transforms import ConfigError
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from ._batch import (
    Batch,
    PaddingStats,
    Sample,
    collate,
    estimate_token_budget,
    fit_token_budget,
    real_tokens,
)
from ._config import DatasetSpec, ModelConfig, dataset_spec
from ._files import load_file_dataset
from ._synthetic import SyntheticDataset


class SampleSource(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Sample: ...


@dataclass
class Data:
    """A dataset's train and eval samples plus the collation settings."""

    spec: DatasetSpec
    config: ModelConfig
    train: SampleSource
    eval: SampleSource
    batch_size: int
    seed: int
    shuffle: bool
    stats: PaddingStats = field(default_factory=PaddingStats)
    # real tokens per global train batch that its per-token layers compute (None: every padded slot)
    token_budget: int | None = None
    # several budgets (make_data(token_buckets=K), ascending, the last == token_budget): each train batch
    # packs into the smallest that holds its real tokens, one compiled step per budget; () = one budget
    token_buckets: tuple[int, ...] = ()
    bucket_report: str = ""  # how the buckets were chosen, for the log

    @property
    def rows(self) -> dict[str, int]:
        return {f: self.config.table_rows(t) for t in self.spec.tables for f in t.features}

    @property
    def batches_per_epoch(self) -> int:
        return max(len(self.train) // self.batch_size, 1)

    def _collate(self, samples: Sequence[Sample], budget: int | None = None) -> Batch:
        cfg = self.config
        return collate(samples, self.spec, cfg.uih_len, cfg.num_candidates, self.rows, token_budget=budget)

    def budget_for(self, samples: Sequence[Sample]) -> int | None:
        """The token budget the global train batch `samples` packs into: `token_budget`, or with
        `token_buckets` the smallest bucket holding its real tokens (else the largest, which trims)."""
        if not self.token_buckets:
            return self.token_budget
        cfg = self.config
        real = real_tokens(samples, len(self.spec.contextual), cfg.uih_len, cfg.num_candidates)
        return next((b for b in self.token_buckets if b >= real), self.token_buckets[-1])

    def collate_slice(
        self, samples: Sequence[Sample], rank: int, world: int, budget: int | None | str = "auto"
    ) -> Batch:
        """Rank `rank`'s contiguous slice of the global batch `samples` (`world` equal slices). With a
        token budget (`budget`: "auto" for `budget_for(samples)`, else the global batch's) every slice
        is trimmed to its share first, so that the global norms (`Batch.loss_norm`,
        `Batch.max_seq_len`) describe the batch the ranks train on."""
        cfg, n = self.config, len(samples) // world
        total = self.budget_for(samples) if budget == "auto" else budget
        budget = None if total is None else -(-int(total) // world)
        if budget is not None:
            slices = [samples[r * n : (r + 1) * n] for r in range(world)]
            fit = [
                fit_token_budget(s, len(self.spec.contextual), cfg.uih_len, cfg.num_candidates, budget)
                for s in slices
            ]
            samples = [s for kept, _ in fit for s in kept]
        return collate(
            samples[rank * n : (rank + 1) * n], self.spec, cfg.uih_len, cfg.num_candidates, self.rows,
            global_samples=samples, token_budget=budget,
        )  # fmt: skip

    def train_indices(self, step: int) -> list[int]:
        """Sample indices of global train step `step` (epoch-wise permutation when shuffling)."""
        epoch, pos = divmod(step, self.batches_per_epoch)
        n = len(self.train)
        lo = pos * self.batch_size
        if not self.shuffle:
            return [(lo + i) % n for i in range(self.batch_size)]
        perm = np.random.default_rng([self.seed, epoch]).permutation(n)
        return [int(perm[(lo + i) % n]) for i in range(self.batch_size)]

    def train_batch(self, step: int) -> Batch:
        return self.collate_slice([self.train[i] for i in self.train_indices(step)], 0, 1)

    def bucket_examples(self, step: int, rank: int = 0, world: int = 1) -> list[Batch]:
        """Global train step `step`'s batch (this rank's slice) packed into each of `token_buckets`:
        one example per compiled step."""
        samples = [self.train[i] for i in self.train_indices(step)]
        return [self.collate_slice(samples, rank, world, b) for b in self.token_buckets]

    def eval_batches(self, num_batches: int) -> Iterator[Batch]:
        """The first `num_batches` full eval batches, in order (the same every time)."""
        n = len(self.eval)
        for b in range(min(num_batches, max(n // self.batch_size, 1))):
            idx = [(b * self.batch_size + i) % n for i in range(self.batch_size)]
            yield self._collate([self.eval[i] for i in idx])


class _StepBatches(TorchDataset):
    def __init__(self, data: Data, start: int, stop: int) -> None:
        self.data, self.start, self.stop = data, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> Batch:
        return self.data.train_batch(self.start + i)


def _identity(batch: Batch) -> Batch:
    return batch


def train_batches(data: Data, start: int, stop: int, num_workers: int) -> Iterator[Batch]:
    """Batches of global steps start..stop-1, built by `num_workers` DataLoader workers (0 = inline)."""
    if num_workers == 0:
        for step in range(start, stop):
            yield data.train_batch(step)
        return
    # An own generator: the DataLoader must not draw from the global RNG that dropout uses.
    loader = DataLoader(
        _StepBatches(data, start, stop),
        batch_size=None,
        num_workers=num_workers,
        collate_fn=_identity,
        generator=torch.Generator().manual_seed(data.seed),
    )
    yield from loader


def make_data(
    name: str,
    config: ModelConfig,
    *,
    batch_size: int,
    seed: int,
    data_dir: str | Path | None = None,
    token_budget: int | str | None = None,
    token_buckets: int = 1,
    bucket_window: int = 64,
) -> Data:
    """The dataset `name` (see `DATASETS`) with its train/eval split. `token_budget` (train batches
    only; eval batches stay unpacked and untrimmed): real tokens per global batch that the per-token
    layers compute, `"auto"` for `estimate_token_budget` over the first 4096 train samples, None for
    every padded slot. `token_buckets` > 1 (with `token_budget="auto"`): that many budgets, chosen by
    `recir.embedding.suggest_buckets` over the real tokens of the first `bucket_window` train batches."""
    if batch_size < 1:
        raise ConfigError(f"--batch_size must be >= 1, got {batch_size}")
    spec = dataset_spec(name)
    if name in ("debug", "debug-random"):
        common = dict(
            uih_len=config.uih_len, num_candidates=config.num_candidates, num_items=config.hash_size
        )
        train: SampleSource = SyntheticDataset(spec, seed=seed, split="train", **common)
        evals: SampleSource = SyntheticDataset(spec, seed=seed, split="eval", size=1 << 14, **common)
        data = Data(spec, config, train, evals, batch_size, seed, shuffle=False)
    else:
        tr, ev = load_file_dataset(spec, data_dir)
        data = Data(spec, config, tr, ev, batch_size, seed, shuffle=True)
    data.token_budget = _token_budget(data, token_budget)
    if token_buckets != 1:
        _token_buckets(data, token_budget, token_buckets, bucket_window)
    return data


def _token_buckets(data: Data, budget: int | str | None, k: int, window: int) -> None:
    from recir.embedding import suggest_buckets

    if k < 1 or window < 1:
        raise ConfigError(f"--token_buckets and --bucket_window must be >= 1, got {k} and {window}")
    if budget != "auto":
        raise ConfigError(
            f"--token_buckets {k} chooses its budgets from the data; it takes --token_budget auto (got "
            f"--token_budget {budget}). Fix: add --token_budget auto, or drop --token_buckets."
        )
    cfg, n_ctx = data.config, len(data.spec.contextual)
    slots = data.batch_size * (n_ctx + cfg.uih_len + cfg.num_candidates)
    sizes = [
        real_tokens([data.train[i] for i in data.train_indices(s)], n_ctx, cfg.uih_len, cfg.num_candidates)
        for s in range(window)
    ]
    chosen = suggest_buckets({"tokens": sizes}, max_buckets=k, multiple_of=8).buckets["tokens"]
    data.token_buckets = tuple(sorted({min(b, slots) for b in chosen}))
    data.token_budget = data.token_buckets[-1]

    def waste(buckets: Sequence[int]) -> float:
        rows = [next((b for b in buckets if b >= n), buckets[-1]) for n in sizes]
        return sum(r - min(r, n) for r, n in zip(rows, sizes)) / sum(sizes)

    single = _token_budget(data, "auto") or slots
    data.bucket_report = (
        f"{len(data.token_buckets)} budgets {list(data.token_buckets)} from the real tokens of the first {window} "
        f"train batches (padded rows {waste([slots]):.1%} unpacked, {waste([single]):.1%} with one budget "
        f"of {single}, {waste(data.token_buckets):.1%} with these)"
    )


def _token_budget(data: Data, budget: int | str | None) -> int | None:
    cfg, n_ctx, B = data.config, len(data.spec.contextual), data.batch_size
    floor = B * (n_ctx + cfg.num_candidates)
    if budget is None:
        return None
    if budget == "auto":
        sample = [data.train[i] for i in range(min(len(data.train), 4096))]
        return estimate_token_budget(sample, n_ctx, cfg.uih_len, cfg.num_candidates, B)
    if isinstance(budget, str) and not budget.isdigit():
        raise ConfigError(f"--token_budget must be a number of tokens or 'auto', got {budget!r}")
    value = int(budget)
    if value < floor:
        raise ConfigError(
            f"--token_budget {value} is below a full batch's contextual tokens and candidates ({B} x "
            f"({n_ctx} + {cfg.num_candidates}) = {floor}), which packing never drops. Fix: "
            f"--token_budget auto, or at least {floor} plus the UIH tokens to keep."
        )
    return value
