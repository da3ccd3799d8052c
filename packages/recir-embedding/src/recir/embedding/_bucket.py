"""Bucketing jagged batches to static shapes: each feature's ids are padded to a bucket size.

A captured step compiles once per bucket; ``PadReport`` says how much padding that costs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from recir.transforms import ConfigError

from ._jagged import JaggedBatch
from ._table import EmbeddingTable

log = logging.getLogger("recir.embedding")


def bucketize(n: int, buckets: Sequence[int] | None = None, *, min_size: int = 8) -> int:
    """The smallest bucket ``>= n``: from ``buckets`` if given, else the next power of two (>= min_size)."""
    if buckets is not None:
        for b in sorted(buckets):
            if b >= n:
                return int(b)
        raise ConfigError(f"{n} ids exceed the largest bucket {max(buckets)}; add a larger bucket")
    size = max(int(min_size), 1)
    while size < n:
        size *= 2
    return size


@dataclasses.dataclass(frozen=True)
class PadReport:
    """Real ids and padded slots per feature; ``waste`` = padded slots / real ids."""

    real: Mapping[str, int]
    capacity: Mapping[str, int]

    @property
    def padded(self) -> int:
        return sum(self.capacity[k] - self.real[k] for k in self.real)

    @property
    def waste(self) -> float:
        real = sum(self.real.values())
        return self.padded / real if real else float(self.padded > 0)

    def __str__(self) -> str:
        per = ", ".join(f"{k} {self.real[k]}/{self.capacity[k]}" for k in self.real)
        return f"pad waste {self.waste:.1%} ({self.padded} padded slots; real/capacity: {per})"


def pad_to_bucket(
    batch: Any,
    buckets: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
    *,
    min_size: int = 8,
    padding_id: int = 0,
    tables: Iterable[EmbeddingTable] | None = None,
) -> tuple[JaggedBatch, PadReport]:
    """Pad a ``KeyedJaggedTensor`` (or ``JaggedBatch``) so each feature's ids fill a bucket size.

    ``buckets`` is one list for all features, a per-feature mapping, or None (powers of two).
    The batch is checked (``validate_batch``) unless checks are off. Returns the batch and the report,
    which is also logged at INFO on ``recir.embedding``.
    """
    kjt = batch.to_kjt() if isinstance(batch, JaggedBatch) else batch
    keys = list(kjt.keys())
    counts = kjt.lengths().view(len(keys), kjt.stride()).sum(1).tolist() if keys else []
    caps = {}
    for k, n in zip(keys, counts):
        bk = buckets.get(k) if isinstance(buckets, Mapping) else buckets
        caps[k] = bucketize(int(n), bk, min_size=min_size)
    from ._checks import checks_enabled

    jb = JaggedBatch.from_kjt(kjt, caps, padding_id=padding_id, tables=tables if checks_enabled() else None)
    report = PadReport(dict(zip(keys, (int(c) for c in counts))), caps)
    log.info("recir.embedding.pad_to_bucket: %s", report)
    return jb, report
