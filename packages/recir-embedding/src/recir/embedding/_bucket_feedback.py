"""Bucket feedback: from the jagged sizes a run saw, the bucket set that pads least for its compile count.

Every bucket of a jagged feature is one more captured and compiled step; every id slot between a batch's
real size and its bucket is padding that the step computes for nothing. ``suggest_buckets`` chooses, per
feature, the buckets that minimise the padded slots over the observed batches plus ``compile_cost`` per
bucket, with at most ``max_buckets`` buckets (an exact dynamic programme over the distinct sizes).

>>> sizes = {"item": [9, 10, 12, 40, 41, 200]}
>>> s = suggest_buckets(sizes, max_buckets=3, multiple_of=1)
>>> s.buckets["item"]
(12, 41, 200)
>>> round(padding_waste(sizes, s.buckets), 4)  # 6 padded slots for 312 real ids
0.0192
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence

import torch
from recir.transforms import ConfigError

from ._bucket import bucketize

log = logging.getLogger("recir.embedding")

Sizes = Mapping[str, Mapping[int, int] | Iterable[int]]


def _histogram(observed: Mapping[int, int] | Iterable[int]) -> dict[int, int]:
    if isinstance(observed, Mapping):
        hist = {int(k): int(v) for k, v in observed.items() if int(v) > 0}
    else:
        hist = dict(collections.Counter(int(n) for n in observed))
    if any(n < 0 for n in hist):
        raise ConfigError(f"observed sizes must be >= 0, got {min(hist)}")
    return hist


def padding_waste(sizes: Sizes, buckets: Mapping[str, Sequence[int]] | Sequence[int] | None = None) -> float:
    """Padded slots per real id when every observed size is padded to its bucket (``pad_to_bucket``'s
    rule: ``buckets`` per feature, one list for all, or None for powers of two from 8)."""
    real = padded = 0
    for key, observed in sizes.items():
        per = buckets.get(key) if isinstance(buckets, Mapping) else buckets
        for n, count in _histogram(observed).items():
            real += n * count
            padded += (bucketize(n, per) - n) * count
    return padded / real if real else 0.0


def _round_up(n: int, multiple: int) -> int:
    return max(-(-n // multiple) * multiple, multiple)


def _best_buckets(
    hist: Mapping[int, int], max_buckets: int, compile_cost: float, multiple_of: int
) -> tuple[int, ...]:
    # Candidate bucket sizes: the observed sizes rounded up to the alignment. An optimal bucket never
    # lies strictly between two candidates (lowering it to the candidate below pads less), so the
    # buckets are a subset of the candidates that contains the largest one.
    weight: dict[int, int] = collections.Counter()
    for n, count in hist.items():
        weight[_round_up(n, multiple_of)] += count
    cand = sorted(weight)
    m = len(cand)
    values = torch.tensor(cand, dtype=torch.float64)
    counts = torch.tensor([weight[c] for c in cand], dtype=torch.float64)
    # padding of the sizes rounded to their candidate is fixed; the DP counts what buckets add to it
    cum_c = torch.cat([torch.zeros(1, dtype=torch.float64), counts.cumsum(0)])
    cum_s = torch.cat([torch.zeros(1, dtype=torch.float64), (counts * values).cumsum(0)])
    inf = float("inf")
    # best[k][i]: least padding of candidates 0..i covered by k+1 buckets, the last one at candidate i
    best = torch.full((max_buckets, m), inf, dtype=torch.float64)
    back = torch.zeros((max_buckets, m), dtype=torch.int64)
    best[0] = values * cum_c[1:] - cum_s[1:]
    for k in range(1, max_buckets):
        for i in range(k, m):
            j = torch.arange(k, i + 1)  # candidates j..i go to the bucket at i; j-1 ends the previous
            cost = best[k - 1, j - 1] + values[i] * (cum_c[i + 1] - cum_c[j]) - (cum_s[i + 1] - cum_s[j])
            at = int(torch.argmin(cost))
            best[k, i], back[k, i] = cost[at], int(j[at]) - 1
    totals = best[:, m - 1] + compile_cost * torch.arange(1, max_buckets + 1, dtype=torch.float64)
    k = int(torch.argmin(totals))
    chosen, i = [], m - 1
    while k >= 0:
        chosen.append(cand[i])
        i, k = int(back[k, i]), k - 1
    return tuple(sorted(chosen))


@dataclasses.dataclass(frozen=True)
class BucketSuggestion:
    """Per-feature buckets and the padding waste (padded slots per real id) of the observed sizes before
    (under the policy that ran: ``current``) and after."""

    buckets: dict[str, tuple[int, ...]]
    waste_before: float
    waste_after: float
    compiles_before: int
    compiles_after: int

    def __str__(self) -> str:
        per = "; ".join(f"{k} {list(v)}" for k, v in self.buckets.items())
        return (
            f"suggested buckets: {per} (padding waste {self.waste_before:.1%} -> {self.waste_after:.1%}, "
            f"buckets per feature at most {self.compiles_before} -> {self.compiles_after})"
        )


def suggest_buckets(
    sizes: Sizes,
    *,
    max_buckets: int = 4,
    compile_cost: float = 0.0,
    multiple_of: int = 8,
    current: Mapping[str, Sequence[int]] | Sequence[int] | None = None,
) -> BucketSuggestion:
    """The buckets that minimise padding plus ``compile_cost`` per bucket for the observed ``sizes``.

    ``sizes`` maps each jagged feature to the real id counts of the batches seen (a list, or a
    ``{size: times}`` histogram, e.g. ``BucketedStep.sizes``). ``compile_cost`` is what one more bucket
    (one more compile) is worth, in padded id slots over the observed window; 0 uses up to
    ``max_buckets``. Buckets are multiples of ``multiple_of``. ``current`` is the policy the sizes were
    padded with (None: powers of two), for the before/after report. Pass ``buckets`` to
    ``pad_to_bucket`` (or ``BucketedStep(batch_buckets=...)``).
    """
    if max_buckets < 1 or multiple_of < 1 or compile_cost < 0:
        raise ConfigError(
            f"suggest_buckets: max_buckets and multiple_of must be >= 1 and compile_cost >= 0, got "
            f"{max_buckets}, {multiple_of}, {compile_cost}"
        )
    hists = {key: _histogram(observed) for key, observed in sizes.items()}
    empty = [key for key, h in hists.items() if not h]
    if empty or not hists:
        raise ConfigError(
            f"suggest_buckets: no observed sizes for {empty or 'any feature'}. Fix: run some batches first "
            "(BucketedStep records them) or pass each feature's sizes."
        )
    buckets = {k: _best_buckets(h, max_buckets, compile_cost, multiple_of) for k, h in hists.items()}

    def used(policy: Mapping[str, Sequence[int]] | Sequence[int] | None) -> int:
        per_key = (policy.get(k) if isinstance(policy, Mapping) else policy for k in hists)
        return max(len({bucketize(n, p) for n in hists[k]}) for k, p in zip(hists, per_key))

    return BucketSuggestion(
        buckets=buckets,
        waste_before=padding_waste(hists, current),
        waste_after=padding_waste(hists, buckets),
        compiles_before=used(current),
        compiles_after=used(buckets),
    )


class AutoBuckets:
    """A bucket policy that learns its buckets: ``BucketedStep(batch_buckets=AutoBuckets(window=64))``.

    For the first ``window`` batches it pads with ``warmup`` (None: each feature's next power of two, at
    least 8); then ``suggest_buckets`` over the sizes those batches had (``BucketedStep.sizes``) fixes
    each feature's buckets for the rest of the run, logged with the padding waste before and after. A
    later batch larger than every suggested bucket of a feature pads to the next power of two (one more
    compile) instead of failing. Bucket choice changes only shapes: padding repeats a real id and
    belongs to no sample, so the steps compute the same numbers with any buckets::

        batches 1..64:   item 37 ids -> 64 slots, item 70 -> 128, ...        (powers of two)
        after batch 64:  suggested item (40, 72, 96, 128)  waste 41% -> 6%    (then these)
    """

    def __init__(
        self,
        window: int = 64,
        *,
        max_buckets: int = 4,
        compile_cost: float = 0.0,
        multiple_of: int = 8,
        warmup: Mapping[str, Sequence[int]] | Sequence[int] | None = None,
    ) -> None:
        if window < 1 or max_buckets < 1 or multiple_of < 1 or compile_cost < 0:
            raise ConfigError(
                f"AutoBuckets: window, max_buckets and multiple_of must be >= 1 and compile_cost >= 0, got "
                f"window={window}, max_buckets={max_buckets}, multiple_of={multiple_of}, "
                f"compile_cost={compile_cost}. Fix: e.g. AutoBuckets(window=64, max_buckets=4)."
            )
        self.window = window
        self.max_buckets, self.compile_cost, self.multiple_of = max_buckets, compile_cost, multiple_of
        self.warmup = warmup
        self.suggestion: BucketSuggestion | None = None
        self._learned: dict[str, tuple[int, ...]] | None = None

    @property
    def buckets(self) -> Mapping[str, Sequence[int]] | Sequence[int] | None:
        """The policy to pad the next batch with (``pad_to_bucket``'s ``buckets``)."""
        return self.warmup if self._learned is None else self._learned

    def observe(self, sizes: Sizes, batches: int) -> bool:
        """After each batch: ``sizes`` so far over ``batches`` batches. True when the buckets change."""
        if self._learned is not None or batches < self.window:
            return False
        self.suggestion = suggest_buckets(
            sizes,
            max_buckets=self.max_buckets,
            compile_cost=self.compile_cost,
            multiple_of=self.multiple_of,
            current=self.warmup,
        )
        # past the largest suggested bucket: powers of two, so an unseen larger batch still has a bucket
        self._learned = {
            k: (*b, *(1 << e for e in range(3, 40) if (1 << e) > max(b)))
            for k, b in self.suggestion.buckets.items()
        }
        log.info("recir.embedding.AutoBuckets: after %d batches, %s", batches, self.suggestion)
        return True

    def __repr__(self) -> str:
        state = "warming up" if self.suggestion is None else str(self.suggestion)
        return f"AutoBuckets(window={self.window}, max_buckets={self.max_buckets}: {state})"
