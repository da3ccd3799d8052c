"""Input checks for jagged batches: id ranges, lengths, feature coverage and captured keys.

On by default; ``RECIR_EMBEDDING_CHECKS=0`` or ``with checks(False):`` turns them off for speed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence

import torch
from recir.transforms import DataError

_FORCED: list[bool] = []


def checks_enabled() -> bool:
    """Whether batch checks run (``with checks(...)`` wins over ``RECIR_EMBEDDING_CHECKS``)."""
    if _FORCED:
        return _FORCED[-1]
    return os.environ.get("RECIR_EMBEDDING_CHECKS", "1").strip().lower() not in ("0", "false", "off", "no")


@contextlib.contextmanager
def checks(enabled: bool) -> Iterator[None]:
    """Turn batch checks on or off inside the block (also at capture time: no check node is traced)."""
    _FORCED.append(bool(enabled))
    try:
        yield
    finally:
        _FORCED.pop()


def check_lengths(feature: str, lengths: torch.Tensor, num_values: int, *, capacity: bool = False) -> None:
    """Lengths are non-negative and sum to ``num_values`` (at most, when ``capacity``)."""
    neg = (lengths < 0).nonzero()
    if neg.numel():
        b = int(neg[0, 0])
        raise DataError(
            f"feature {feature!r}: length {int(lengths[b])} at batch position {b} is negative. "
            "Fix: lengths count the ids of each sample and must be >= 0."
        )
    total = int(lengths.sum())
    if total > num_values if capacity else total != num_values:
        what = "the feature's capacity" if capacity else "the number of values"
        raise DataError(
            f"feature {feature!r}: lengths sum to {total} but {what} is {num_values} "
            f"(lengths per batch position: {lengths.tolist()[:16]}). "
            "Fix: lengths and values must describe the same ids."
        )


def check_ids(feature: str, table: str, num_rows: int, ids: torch.Tensor, lengths: torch.Tensor) -> None:
    """Every real id of ``feature`` lies in ``[0, num_rows)`` of ``table``; names the batch position."""
    n = int(lengths.sum())
    real = ids[:n]
    bad = ((real < 0) | (real >= num_rows)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        b = int(torch.searchsorted(torch.cumsum(lengths, 0), torch.tensor(i), right=True))
        raise DataError(
            f"table {table!r} (feature {feature!r}): id {int(real[i])} at batch position {b} "
            f"(value {i} of the feature) is outside [0, {num_rows}). "
            "Fix: hash or clip ids into the table's range, or enlarge the table."
        )


def check_keys(keys: Sequence[str], expected: Sequence[str]) -> None:
    """The batch has exactly the captured features, in order."""
    if list(keys) == list(expected):
        return
    missing = [k for k in expected if k not in keys]
    extra = [k for k in keys if k not in expected]
    if missing or extra:
        detail = f"missing feature {missing[0]!r}" if missing else f"unexpected feature {extra[0]!r}"
    else:
        pos = next(i for i, (a, b) in enumerate(zip(keys, expected)) if a != b)
        detail = f"feature {keys[pos]!r} at key position {pos}, captured {expected[pos]!r}"
    raise DataError(
        f"the batch's features differ from the captured ones: {detail}.\n"
        f"  expected: {list(expected)}\n  actual:   {list(keys)}\n"
        "Fix: pass batches with the features (and order) of the example batch used at capture."
    )


def check_coverage(keys: Sequence[str], feature_tables: Mapping[str, object]) -> None:
    """Every feature of the batch is looked up by some table."""
    for k in keys:
        if k not in feature_tables:
            raise DataError(
                f"feature {k!r} has no table (tables cover {sorted(feature_tables)}). "
                "Fix: add the feature to a table's features, or drop it from the batch."
            )
