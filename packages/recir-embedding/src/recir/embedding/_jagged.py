"""JaggedBatch: RecIR's static-shape jagged batch, a pytree whose spec holds keys and per-feature sizes.

TorchRec's ``KeyedJaggedTensor`` flattens to data-dependent per-key sizes (its splits call ``.tolist()``),
so a captured step takes ``JaggedBatch`` leaves instead: ``values`` holds each feature's ids in a
fixed-size segment (``capacities``), real ids first, then padding ids that belong to no sample.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from recir.transforms import DataError
from torch import Tensor

from ._checks import check_coverage, check_ids, check_keys, check_lengths, checks_enabled
from ._table import EmbeddingTable, feature_to_table


class JaggedBatch:
    """Features ``keys`` over ``batch_size`` samples, each feature in a static-size slot of ``values``.

    - ``values``: int64 ``[sum(capacities)]``; feature ``i`` owns ``values[start_i : start_i + capacities[i]]``,
      its ``sum(lengths of i)`` real ids first, then padding.
    - ``lengths``: int64 ``[len(keys) * batch_size]``, key-major like a KJT.
    - ``weights``: optional float ``[sum(capacities)]`` per-id weights, laid out like ``values``.

    As a pytree, the leaves are ``values, lengths[, weights]`` and the spec holds ``keys``,
    ``batch_size`` and ``capacities``, so a captured step compiles once per bucket of capacities.
    """

    __slots__ = ("keys_", "values_", "lengths_", "weights_", "batch_size", "capacities")

    def __init__(
        self,
        keys: Sequence[str],
        values: Tensor,
        lengths: Tensor,
        batch_size: int,
        capacities: Sequence[int],
        weights: Tensor | None = None,
    ) -> None:
        self.keys_ = tuple(keys)
        self.values_ = values
        self.lengths_ = lengths
        self.weights_ = weights
        self.batch_size = int(batch_size)
        self.capacities = tuple(int(c) for c in capacities)
        if len(self.capacities) != len(self.keys_):
            raise DataError(f"JaggedBatch: {len(self.keys_)} keys but {len(self.capacities)} capacities")
        # Shapes are static even under fake tensors, so these checks also hold while tracing.
        if values.shape[0] != sum(self.capacities):
            raise DataError(
                f"JaggedBatch: values has {values.shape[0]} entries, capacities {self.capacities} "
                f"sum to {sum(self.capacities)}"
            )
        if lengths.shape[0] != len(self.keys_) * self.batch_size:
            raise DataError(
                f"JaggedBatch: lengths has {lengths.shape[0]} entries, expected "
                f"{len(self.keys_)} keys x batch {self.batch_size}"
            )

    # -- KJT-like accessors -----------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self.keys_)

    def values(self) -> Tensor:
        return self.values_

    def lengths(self) -> Tensor:
        return self.lengths_

    def weights_or_none(self) -> Tensor | None:
        return self.weights_

    def stride(self) -> int:
        return self.batch_size

    def starts(self) -> list[int]:
        out, s = [], 0
        for c in self.capacities:
            out.append(s)
            s += c
        return out

    def index(self, key: str) -> int:
        try:
            return self.keys_.index(key)
        except ValueError:
            raise DataError(f"feature {key!r} is not in the batch (keys {list(self.keys_)})") from None

    def segment(self, key: str) -> tuple[Tensor, Tensor]:
        """``(ids [capacity], lengths [batch_size])`` of one feature; static slices, traceable."""
        i = self.index(key)
        start, cap, b = self.starts()[i], self.capacities[i], self.batch_size
        return self.values_[start : start + cap], self.lengths_[i * b : (i + 1) * b]

    def num_ids(self) -> list[int]:
        """Real ids per feature (reads the lengths; eager only)."""
        return self.lengths_.view(len(self.keys_), self.batch_size).sum(1).tolist()

    def split_samples(self, parts: int, index: int, *, padding_id: int = 0) -> JaggedBatch:
        """Samples ``[index * B / parts, (index + 1) * B / parts)`` of every feature (eager only).

        Each feature keeps its capacity (every part has the same static shapes), its ids compacted to
        the front of the slot and padded like :meth:`from_kjt` (the part's first id of the feature, or
        ``padding_id`` when it has none; weights padded with 0). Data-parallel batch splitting calls it.
        """
        b = self.batch_size
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise DataError(f"JaggedBatch.split_samples: parts must be a positive int, got {parts!r}")
        if b % parts:
            lo = b // parts * parts
            raise DataError(
                f"JaggedBatch.split_samples: batch size {b} does not split into {parts} equal parts. "
                f"Fix: use a batch size that is a multiple of {parts} (e.g. {lo or parts} or {lo + parts})."
            )
        if not 0 <= index < parts:
            raise DataError(f"JaggedBatch.split_samples: part {index} is outside 0..{parts - 1}")
        n = b // parts
        k = len(self.keys_)
        per_key = self.lengths_.view(k, b)
        lengths = per_key[:, index * n : (index + 1) * n]
        before = per_key[:, : index * n].sum(1).tolist()
        counts = lengths.sum(1).tolist()
        segs, wsegs = [], []
        for i, (start, cap) in enumerate(zip(self.starts(), self.capacities)):
            lo, cnt = start + int(before[i]), int(counts[i])
            seg = self.values_[lo : lo + cnt]
            fill = seg[:1] if cnt else self.values_.new_tensor([padding_id])
            segs.append(torch.cat([seg, fill.expand(cap - cnt)]))
            if self.weights_ is not None:
                w = self.weights_[lo : lo + cnt]
                wsegs.append(torch.cat([w, w.new_zeros(cap - cnt)]))
        values = torch.cat(segs) if segs else self.values_[:0].clone()
        weights = None
        if self.weights_ is not None:
            weights = torch.cat(wsegs) if wsegs else self.weights_[:0].clone()
        return JaggedBatch(self.keys_, values, lengths.reshape(-1).clone(), n, self.capacities, weights)

    # -- conversion -------------------------------------------------------------------------------
    @classmethod
    def from_kjt(
        cls,
        kjt: Any,
        capacities: Sequence[int] | Mapping[str, int] | None = None,
        *,
        padding_id: int = 0,
        tables: Iterable[EmbeddingTable] | None = None,
    ) -> JaggedBatch:
        """From a TorchRec ``KeyedJaggedTensor``; ``capacities`` default to the exact per-key sizes.

        Padding slots repeat the feature's first id (so no extra row is touched by a sparse update)
        or ``padding_id`` when the feature is empty; they belong to no sample.
        """
        keys = list(kjt.keys())
        values = kjt.values().to(torch.int64)
        lengths = kjt.lengths().to(torch.int64)
        weights = kjt.weights_or_none()
        b = kjt.stride()
        if checks_enabled():
            per_key = lengths.view(len(keys), b) if keys else lengths.view(0, b)
            total = 0
            for i, k in enumerate(keys):
                check_lengths(k, per_key[i], int(per_key[i].sum().clamp(min=0)))
                total += int(per_key[i].sum())
            if total != values.shape[0]:
                raise DataError(
                    f"KeyedJaggedTensor: lengths sum to {total} but there are {values.shape[0]} values. "
                    "Fix: lengths and values must describe the same ids."
                )
        counts = lengths.view(len(keys), b).sum(1).tolist() if keys else []
        if capacities is None:
            caps = list(counts)
        elif isinstance(capacities, Mapping):
            caps = [int(capacities[k]) for k in keys]
        else:
            caps = [int(c) for c in capacities]
        segs, wsegs, start = [], [], 0
        for k, n, cap in zip(keys, counts, caps):
            if n > cap:
                raise DataError(f"feature {k!r}: {n} ids do not fit its capacity {cap}")
            seg = values[start : start + n]
            fill = seg[:1] if n else values.new_tensor([padding_id])
            segs.append(torch.cat([seg, fill.expand(cap - n)]))
            if weights is not None:
                w = weights[start : start + n]
                wsegs.append(torch.cat([w, w.new_zeros(cap - n)]))
            start += n
        flat = torch.cat(segs) if segs else values.new_zeros(0)
        jb = cls(keys, flat, lengths, b, caps, torch.cat(wsegs) if weights is not None else None)
        if tables is not None:
            validate_batch(jb, tables)
        return jb

    def to_kjt(self) -> Any:
        """The TorchRec ``KeyedJaggedTensor`` with the padding stripped."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        vals, ws = [], []
        for k, n in zip(self.keys_, self.num_ids()):
            seg, _ = self.segment(k)
            vals.append(seg[:n])
            if self.weights_ is not None:
                i = self.index(k)
                ws.append(self.weights_[self.starts()[i] : self.starts()[i] + n])
        return KeyedJaggedTensor(
            keys=list(self.keys_),
            values=torch.cat(vals) if vals else self.values_[:0],
            lengths=self.lengths_,
            weights=torch.cat(ws) if ws else None,
            stride=self.batch_size,
        )

    @classmethod
    def from_jagged_tensors(
        cls, features: Mapping[str, Any], capacities: Sequence[int] | Mapping[str, int] | None = None
    ) -> JaggedBatch:
        """From ``{feature: torchrec JaggedTensor}`` (all with the same batch size)."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        return cls.from_kjt(KeyedJaggedTensor.from_jt_dict(dict(features)), capacities)

    def to_jagged_tensors(self) -> dict[str, Any]:
        """``{feature: torchrec JaggedTensor}`` of the real ids (padding stripped)."""
        return self.to_kjt().to_dict()

    def __repr__(self) -> str:
        return (
            f"JaggedBatch(keys={list(self.keys_)}, batch_size={self.batch_size}, "
            f"capacities={list(self.capacities)}, weighted={self.weights_ is not None})"
        )


def validate_batch(
    batch: JaggedBatch,
    tables: Iterable[EmbeddingTable] | None = None,
    *,
    expected_keys: Sequence[str] | None = None,
) -> None:
    """Raise ``DataError`` (naming table/feature, value, batch position) on a malformed batch.

    Checks: captured keys (``expected_keys``), negative lengths, lengths exceeding a feature's slot,
    features without a table, and ids outside ``[0, rows)`` of their table.
    """
    if expected_keys is not None:
        check_keys(batch.keys(), expected_keys)
    ftab = feature_to_table(tables) if tables is not None else None
    if ftab is not None:
        check_coverage(batch.keys(), ftab)
    for k in batch.keys_:
        ids, lengths = batch.segment(k)
        check_lengths(k, lengths, ids.shape[0], capacity=True)
        if ftab is not None:
            t = ftab[k]
            check_ids(k, t.name, t.num_embeddings, ids, lengths)


def _flatten(jb: JaggedBatch) -> tuple[list[Tensor], tuple[Any, ...]]:
    leaves = [jb.values_, jb.lengths_] + ([jb.weights_] if jb.weights_ is not None else [])
    return leaves, (jb.keys_, jb.batch_size, jb.capacities, jb.weights_ is not None)


def _unflatten(leaves: Iterable[Tensor], context: tuple[Any, ...]) -> JaggedBatch:
    keys, b, caps, weighted = context
    leaves = list(leaves)
    return JaggedBatch(keys, leaves[0], leaves[1], b, caps, leaves[2] if weighted else None)


def _flatten_with_keys(jb: JaggedBatch) -> tuple[list[tuple[Any, Tensor]], tuple[Any, ...]]:
    leaves, ctx = _flatten(jb)
    names = ["values", "lengths", "weights"][: len(leaves)]
    return [(pytree.GetAttrKey(n), leaf) for n, leaf in zip(names, leaves)], ctx


pytree.register_pytree_node(
    JaggedBatch,
    _flatten,
    _unflatten,
    flatten_with_keys_fn=_flatten_with_keys,
    serialized_type_name="recir.embedding.JaggedBatch",
)


def _spec_layouts(spec: Any) -> list[tuple[Any, ...]]:
    """The (keys, batch_size, capacities, weighted) of every JaggedBatch in a batch TreeSpec, in order."""
    if spec is None:
        return []
    if spec.type is JaggedBatch:
        return [spec.context]
    # torch 2.10 deprecates the `children_specs` field for the `children()` method.
    children = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
    return [ctx for child in children for ctx in _spec_layouts(child)]


def validate_step_batch(step: Any, batch: Any, tables: Iterable[EmbeddingTable] | None = None) -> None:
    """Check a batch's JaggedBatches against those ``step`` (a StepGraph) was captured with.

    Raises ``DataError`` naming the first differing feature (keys, batch size or capacity), then runs
    :func:`validate_batch` on each (ids against ``tables`` when given).
    """
    expected = _spec_layouts(step.signature.batch_spec)
    leaves = pytree.tree_leaves(batch, is_leaf=lambda x: isinstance(x, JaggedBatch))
    found = [x for x in leaves if isinstance(x, JaggedBatch)]
    if len(found) != len(expected):
        raise DataError(
            f"the batch holds {len(found)} JaggedBatch(es), the step was captured with {len(expected)}. "
            "Fix: pass batches with the structure of the example batch."
        )
    for jb, (keys, b, caps, _) in zip(found, expected):
        validate_batch(jb, tables, expected_keys=keys)
        if jb.batch_size != b:
            raise DataError(f"batch size {jb.batch_size} differs from the captured {b}")
        for k, cap, want in zip(keys, jb.capacities, caps):
            if cap != want:
                raise DataError(
                    f"feature {k!r}: capacity {cap} differs from the captured {want}. "
                    "Fix: pad with the capture's buckets (pad_to_bucket(..., buckets)) or capture this bucket too."
                )
