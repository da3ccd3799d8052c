"""Static-shape lookups over JaggedBatch segments: pooled bags and unpooled sequences.

Each table becomes one ``recir::*`` op call over its features' fixed-size id segments; padding ids sit in
a trailing "trash" bag per feature (pooled) or are masked to zero rows (sequence), so they get no gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from recir.transforms import CaptureError
from torch import Tensor

from ._checks import checks_enabled
from ._jagged import JaggedBatch
from ._table import EmbeddingTable

Segment = tuple[Tensor, Tensor]  # (ids [capacity], lengths [batch])


def as_jagged(features: Any, where: str) -> JaggedBatch:
    """A JaggedBatch from the module input: a JaggedBatch, or a KJT (eager, or with cached per-key sizes)."""
    if isinstance(features, JaggedBatch):
        return features
    if hasattr(features, "keys") and hasattr(features, "lengths") and hasattr(features, "values"):
        lpk = getattr(features, "_length_per_key", None)
        if lpk is not None:
            return JaggedBatch(
                list(features.keys()),
                features.values().to(torch.int64),
                features.lengths().to(torch.int64),
                features.stride(),
                list(lpk),
                features.weights_or_none(),
            )
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        if get_proxy_mode() is not None or isinstance(features.values(), FakeTensor):
            raise CaptureError(
                f"{where}: a KeyedJaggedTensor reached the embedding lookup during capture, but its "
                "per-feature sizes are data-dependent (TorchRec splits it with .tolist()). "
                "Fix: put a recir.embedding.JaggedBatch in the batch instead "
                "(recir.embedding.pad_to_bucket(kjt) or JaggedBatch.from_kjt(kjt))."
            )
        return JaggedBatch.from_kjt(features)
    raise CaptureError(f"{where}: expected a JaggedBatch or KeyedJaggedTensor, got {type(features).__name__}")


def checked(jb: JaggedBatch, tables: Sequence[EmbeddingTable]) -> JaggedBatch:
    """Route the batch's values through ``recir::check_jagged`` (a no-op when checks are off)."""
    if not checks_enabled():
        return jb
    by_feature = {f: t for t in tables for f in t.features}
    names = [by_feature[k].name if k in by_feature else "" for k in jb.keys_]
    rows = [by_feature[k].num_embeddings if k in by_feature else 0 for k in jb.keys_]
    values = torch.ops.recir.check_jagged(
        jb.values_, jb.lengths_, jb.batch_size, list(jb.capacities), rows, ",".join(jb.keys_), ",".join(names)
    )
    return JaggedBatch(jb.keys_, values, jb.lengths_, jb.batch_size, jb.capacities, jb.weights_)


def segments(jb: JaggedBatch, features: Sequence[str], where: str) -> list[Segment]:
    missing = [f for f in features if f not in jb.keys_]
    if missing:
        raise CaptureError(
            f"{where}: feature {missing[0]!r} of its tables is not in the batch (keys {list(jb.keys_)}). "
            "Fix: add it to the batch."
        )
    return [jb.segment(f) for f in features]


def pooled_lookup(
    weight: Tensor, segs: Sequence[Segment], mode: int, per_sample_weights: Tensor | None = None
) -> list[Tensor]:
    """One ``recir::embedding_bag`` over all segments; returns a ``[batch, D]`` tensor per segment.

    Feature i's bags are followed by a trash bag holding its padding ids (dropped from the output).
    """
    k, b = len(segs), segs[0][1].shape[0]
    ids = torch.cat([s[0] for s in segs])
    offs, base = [], 0
    for ids_f, len_f in segs:
        offs.append(torch.cat([len_f.new_zeros(1), torch.cumsum(len_f, 0)]) + base)
        base += ids_f.shape[0]
    offs.append(segs[0][1].new_full((1,), base))
    out = torch.ops.recir.embedding_bag(weight, ids, torch.cat(offs), per_sample_weights, mode)
    out = out.view(k, b + 1, weight.shape[1])
    return [out[i, :b] for i in range(k)]


def sequence_lookup(weight: Tensor, segs: Sequence[Segment]) -> list[Tensor]:
    """One ``recir::embedding`` over all segments; a ``[capacity, D]`` tensor per segment, padding rows 0."""
    rows = torch.ops.recir.embedding(weight, torch.cat([s[0] for s in segs]))
    outs, start = [], 0
    for ids_f, len_f in segs:
        cap = ids_f.shape[0]
        mask = torch.arange(cap, device=ids_f.device) < len_f.sum()
        outs.append(rows[start : start + cap] * mask.unsqueeze(1).to(rows.dtype))
        start += cap
    return outs
