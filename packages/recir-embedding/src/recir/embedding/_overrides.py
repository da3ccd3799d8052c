"""Overrides for TorchRec ``EmbeddingBagCollection``/``EmbeddingCollection`` and FBGEMM's dense TBE.

Each stand-in shares the original parameters (slot names stay ``param:<path>.embedding_bags.<t>.weight``)
and performs one ``recir::*`` lookup per table over a static-shape ``JaggedBatch``.
"""

from __future__ import annotations

import torch
from recir.transforms import CaptureError, Override
from torch import Tensor, nn

from ._embedding_bag_override import EmbeddingBagOverride
from ._jagged import JaggedBatch
from ._lookup import as_jagged, checked, pooled_lookup, segments, sequence_lookup
from ._ops import EMBEDDING_OVERRIDE
from ._table import EmbeddingTable, tables_from_torchrec

_MODES = {"sum": 0, "mean": 1}


class EmbeddingBagCollectionStandIn(nn.Module):
    """Traceable ``EmbeddingBagCollection``: ``JaggedBatch``/KJT -> ``KeyedTensor`` (features in table order)."""

    def __init__(self, ebc: nn.Module, path: str) -> None:
        super().__init__()
        self.embedding_bags = ebc.embedding_bags  # shared: same parameters, same names
        self.tables: list[EmbeddingTable] = tables_from_torchrec(ebc)
        self.is_weighted = bool(ebc.is_weighted())
        self.path = path or "<root>"

    def forward(self, features: object) -> object:
        from torchrec.sparse.jagged_tensor import KeyedTensor

        where = f"EmbeddingBagCollection at {self.path!r}"
        jb = checked(as_jagged(features, where), self.tables)
        keys, dims, outs = [], [], []
        for t in self.tables:
            segs = segments(jb, t.features, where)
            psw = None
            if self.is_weighted:
                if jb.weights_ is None:
                    raise CaptureError(f"{where} is weighted but the batch has no weights")
                psw = torch.cat([jb.weights_[s : s + c] for s, c in self._spans(jb, t.features)])
                if t.pooling != "sum":
                    raise CaptureError(
                        f"{where}: table {t.name!r} is weighted; only sum pooling is supported"
                    )
            outs += pooled_lookup(self.embedding_bags[t.name].weight, segs, _MODES[t.pooling], psw)
            keys += list(t.features)
            dims += [t.dim] * len(t.features)
        return KeyedTensor(keys=keys, length_per_key=dims, values=torch.cat(outs, dim=1))

    @staticmethod
    def _spans(jb: JaggedBatch, features: tuple[str, ...]) -> list[tuple[int, int]]:
        starts = jb.starts()
        return [(starts[jb.index(f)], jb.capacities[jb.index(f)]) for f in features]


class EmbeddingCollectionStandIn(nn.Module):
    """Traceable ``EmbeddingCollection``: ``JaggedBatch``/KJT -> ``{feature: JaggedTensor}``.

    Each feature's values are ``[capacity, D]`` (static): its real ids' rows, then zero rows for padding.
    """

    def __init__(self, ec: nn.Module, path: str) -> None:
        super().__init__()
        self.embeddings = ec.embeddings
        self.tables: list[EmbeddingTable] = tables_from_torchrec(ec)
        self.path = path or "<root>"

    def forward(self, features: object) -> dict[str, object]:
        from torchrec.sparse.jagged_tensor import JaggedTensor

        where = f"EmbeddingCollection at {self.path!r}"
        jb = checked(as_jagged(features, where), self.tables)
        out: dict[str, object] = {}
        for t in self.tables:
            segs = segments(jb, t.features, where)
            for f, (_, lengths), rows in zip(
                t.features, segs, sequence_lookup(self.embeddings[t.name].weight, segs)
            ):
                out[f] = JaggedTensor(values=rows, lengths=lengths)
        return out


class DenseTBEStandIn(nn.Module):
    """Traceable FBGEMM ``DenseTableBatchedEmbeddingBagsCodegen`` (tables of one dim, sum/mean pooling).

    Its flat ``weights`` parameter stays ordinary state; the gradient reaches it as
    ``zeros(rows, D).index_add(ids + table row offset, g).view(-1)``, and the optimizer is the graph's.
    """

    def __init__(self, tbe: nn.Module, path: str) -> None:
        super().__init__()
        self.weights = tbe.weights
        specs = list(tbe.embedding_specs)
        dims = {d for _, d in specs}
        if len(dims) != 1:
            raise CaptureError(f"TBE at {path!r}: tables of different dims {sorted(dims)} are not supported")
        self.dim = dims.pop()
        self.rows = sum(r for r, _ in specs)
        self.hash_cumsum = [int(x) for x in tbe.hash_size_cumsum.tolist()[:-1]]  # per feature
        mode = int(tbe.pooling_mode)
        if mode not in (0, 1):
            raise CaptureError(f"TBE at {path!r}: pooling mode {tbe.pooling_mode} (only SUM/MEAN supported)")
        self.mode = mode

    def forward(self, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None = None) -> Tensor:
        t = len(self.hash_cumsum)
        b = (offsets.shape[0] - 1) // t
        indices, offsets = indices.to(torch.int64), offsets.to(torch.int64)
        pos = torch.arange(indices.shape[0], device=indices.device)
        feature = torch.searchsorted(offsets[b::b][: t - 1].contiguous(), pos, right=True)
        shift = torch.zeros_like(indices)
        for f, base in enumerate(self.hash_cumsum):
            if base:
                shift = shift + (feature == f).to(torch.int64) * base
        w = self.weights.view(self.rows, self.dim)
        out = torch.ops.recir.embedding_bag(w, indices + shift, offsets, per_sample_weights, self.mode)
        return out.view(t, b, self.dim).permute(1, 0, 2).reshape(b, t * self.dim)


class EmbeddingBagCollectionOverride(Override):
    name = "recir-embedding-bag"
    ops = ("recir::embedding_bag",)

    def matches(self, module: nn.Module) -> bool:
        try:
            from torchrec.modules.embedding_modules import EmbeddingBagCollection
        except ImportError:  # TorchRec is optional: a model without it holds no TorchRec module
            return False
        return isinstance(module, EmbeddingBagCollection)

    def replace(self, module: nn.Module, path: str) -> nn.Module:
        return EmbeddingBagCollectionStandIn(module, path)


class EmbeddingCollectionOverride(Override):
    name = EMBEDDING_OVERRIDE
    ops = ("recir::embedding",)

    def matches(self, module: nn.Module) -> bool:
        try:
            from torchrec.modules.embedding_modules import EmbeddingCollection
        except ImportError:
            return False
        return isinstance(module, EmbeddingCollection)

    def replace(self, module: nn.Module, path: str) -> nn.Module:
        return EmbeddingCollectionStandIn(module, path)


class DenseTBEOverride(Override):
    name = "recir-embedding-tbe"
    ops = ()  # its lookups are recir::embedding_bag nodes, owned by recir-embedding-bag

    def matches(self, module: nn.Module) -> bool:
        try:
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
                DenseTableBatchedEmbeddingBagsCodegen,
            )
        except ImportError:
            return False
        return isinstance(module, DenseTableBatchedEmbeddingBagsCodegen)

    def replace(self, module: nn.Module, path: str) -> nn.Module:
        return DenseTBEStandIn(module, path)


def overrides() -> tuple[Override, ...]:
    """The overrides for TorchRec EBC/EC, FBGEMM's dense TBE and plain ``nn.EmbeddingBag``; pass them to
    ``capture_train_step``. Modules are matched outermost first, so the ``nn.EmbeddingBag`` tables inside a
    TorchRec EBC are the EBC override's, not :class:`EmbeddingBagOverride`'s."""
    return (
        EmbeddingBagCollectionOverride(),
        EmbeddingCollectionOverride(),
        DenseTBEOverride(),
        EmbeddingBagOverride(),
    )
