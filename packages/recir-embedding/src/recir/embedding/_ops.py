"""recir-embedding's ``recir::*`` ops: the sequence lookup, the in-graph batch check, backend kernels.

``recir::embedding`` (unpooled lookup) has a fake impl, an ATen gradient ``zeros.index_add(0, ids, g)``
(the pattern the sparse-update transform rewrites) and a pure-ATen reference. The ``fbgemm_*`` and
``torchrec_*`` ops are forward-only kernels that ``prepare_for_lowering`` puts at graph boundaries.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from recir.transforms import narrow_through_indices, register_override_op
from torch import Tensor

from ._checks import check_ids, check_lengths
from ._versions import check_fbgemm

EMBEDDING_OVERRIDE = "recir-embedding-collection"
FBGEMM_BACKEND = "recir-embedding-fbgemm"
TORCHREC_BACKEND = "recir-embedding-torchrec"
CHECK_OVERRIDE = "recir-embedding-check"


def embedding_reference(weight: Tensor, ids: Tensor) -> Tensor:
    """Pure-ATen unpooled lookup: ``weight[ids]``."""
    return weight.index_select(0, ids)


@torch.library.custom_op("recir::embedding", mutates_args=())
def embedding(weight: Tensor, ids: Tensor) -> Tensor:
    """Unpooled (sequence) lookup: one ``[D]`` row per id."""
    return F.embedding(ids, weight)


@embedding.register_fake
def _embedding_fake(weight, ids):
    return weight.new_empty(ids.shape[0], weight.shape[1])


def _embedding_setup(ctx, inputs, output):
    weight, ids = inputs
    ctx.num_rows = weight.shape[0]
    ctx.save_for_backward(ids)


def _embedding_backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    # The dense gradient as zeros.index_add(ids, per-id rows): recir-embed-sparsify-update matches it.
    return grad.new_zeros(ctx.num_rows, grad.shape[1]).index_add(0, ids, grad), None


embedding.register_autograd(_embedding_backward, setup_context=_embedding_setup)
register_override_op("recir::embedding", EMBEDDING_OVERRIDE)
narrow_through_indices(torch.ops.recir.embedding.default)  # a serving head's rows: their ids only


@torch.library.custom_op("recir::check_jagged", mutates_args=())
def check_jagged(
    values: Tensor,
    lengths: Tensor,
    batch_size: int,
    capacities: list[int],
    num_rows: list[int],
    features: str,
    tables: str,
) -> Tensor:
    """Validate a JaggedBatch's ids and lengths at run time; returns a copy of ``values``.

    ``features``/``tables`` are comma-joined names (a table name "" skips the id-range check). Raises
    ``DataError`` naming the table/feature, the value and the batch position.
    """
    v, ln, start = values.detach().cpu(), lengths.detach().cpu(), 0
    names = zip(features.split(","), tables.split(","), num_rows, capacities)
    for i, (f, t, rows, cap) in enumerate(names):
        seg_len = ln[i * batch_size : (i + 1) * batch_size]
        check_lengths(f, seg_len, cap, capacity=True)
        if t:
            check_ids(f, t, rows, v[start : start + cap], seg_len)
        start += cap
    return values.clone()


def check_jagged_reference(
    values: Tensor,
    lengths: Tensor,
    batch_size: int,
    capacities: list[int],
    num_rows: list[int],
    features: str,
    tables: str,
) -> Tensor:
    """In-graph (XLA) form of the check: the values unchanged (XLA cannot raise on data)."""
    return values.clone()


@check_jagged.register_fake
def _check_jagged_fake(values, lengths, batch_size, capacities, num_rows, features, tables):
    return torch.empty_like(values)


register_override_op("recir::check_jagged", CHECK_OVERRIDE)


# -- backend kernels (forward only: the backward is already ATen in the StepGraph) --------------------
def _fbgemm() -> None:
    """Import FBGEMM, or raise ImportError naming the extra to install, or the versions when the installed
    FBGEMM is built for another torch."""
    check_fbgemm()
    try:
        import fbgemm_gpu  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the 'fbgemm' embedding backend needs FBGEMM: install recir-embedding[fbgemm-cpu] "
            "(fbgemm-gpu-cpu) or recir-embedding[fbgemm-gpu] (fbgemm-gpu)"
        ) from e


def fbgemm_has_cuda() -> bool:
    """Whether the installed FBGEMM has CUDA kernels (the `fbgemm-gpu` build, not `fbgemm-gpu-cpu`)."""
    try:
        _fbgemm()
    except ImportError:
        return False
    return bool(
        torch._C._dispatch_has_kernel_for_dispatch_key(
            "fbgemm::dense_embedding_codegen_lookup_function", "CUDA"
        )
    )


def _tbe_lookup(weight: Tensor, ids: Tensor, offsets: Tensor, pooling_mode: int) -> Tensor:
    _fbgemm()
    rows, dim = weight.shape
    dev = weight.device
    return torch.ops.fbgemm.dense_embedding_codegen_lookup_function(
        dev_weights=weight.reshape(-1),
        weights_offsets=torch.zeros(1, dtype=torch.int64, device=dev),
        D_offsets=torch.tensor([0, dim], dtype=torch.int32, device=dev),
        total_D=dim,
        max_D=dim,
        hash_size_cumsum=torch.tensor([0, rows], dtype=torch.int64, device=dev),
        total_hash_size_bits=int(math.log2(float(rows)) + 1),
        indices=ids.to(torch.int64),
        offsets=offsets.to(torch.int64),
        pooling_mode=pooling_mode,
        indice_weights=None,
        feature_requires_grad=None,
        output_dtype=0,
    )


@torch.library.custom_op("recir::fbgemm_embedding_bag", mutates_args=())
def fbgemm_embedding_bag(
    weight: Tensor, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None, mode: int
) -> Tensor:
    """``recir::embedding_bag`` computed by FBGEMM's table-batched kernel (forward only)."""
    if per_sample_weights is not None:
        return torch.ops.recir.embedding_bag(weight, indices, offsets, per_sample_weights, mode)
    return _tbe_lookup(weight.float(), indices, offsets, mode).to(weight.dtype)


@fbgemm_embedding_bag.register_fake
def _bag_fake(weight, indices, offsets, per_sample_weights, mode):
    return weight.new_empty(offsets.shape[0] - 1, weight.shape[1])


@torch.library.custom_op("recir::fbgemm_embedding", mutates_args=())
def fbgemm_embedding(weight: Tensor, ids: Tensor) -> Tensor:
    """``recir::embedding`` computed by FBGEMM's table-batched kernel (pooling NONE, forward only)."""
    offsets = torch.arange(ids.shape[0] + 1, dtype=torch.int64, device=ids.device)
    out = _tbe_lookup(weight.float(), ids, offsets, 2)
    return out.view(ids.shape[0], weight.shape[1]).to(weight.dtype)


fbgemm_embedding.register_fake(_embedding_fake)


@torch.library.custom_op("recir::torchrec_embedding_bag", mutates_args=())
def torchrec_embedding_bag(
    weight: Tensor, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None, mode: int
) -> Tensor:
    """The kernel an unsharded TorchRec ``EmbeddingBagCollection`` runs (``nn.EmbeddingBag``), forward only."""
    return F.embedding_bag(
        indices,
        weight,
        offsets,
        mode=("sum", "mean")[mode],
        per_sample_weights=per_sample_weights,
        include_last_offset=True,
    )


torchrec_embedding_bag.register_fake(_bag_fake)


@torch.library.custom_op("recir::torchrec_embedding", mutates_args=())
def torchrec_embedding(weight: Tensor, ids: Tensor) -> Tensor:
    """The kernel an unsharded TorchRec ``EmbeddingCollection`` runs (``nn.Embedding``), forward only."""
    return F.embedding(ids, weight)


torchrec_embedding.register_fake(_embedding_fake)


for _op in ("fbgemm_embedding_bag", "fbgemm_embedding"):
    register_override_op(f"recir::{_op}", FBGEMM_BACKEND)
for _op in ("torchrec_embedding_bag", "torchrec_embedding"):
    register_override_op(f"recir::{_op}", TORCHREC_BACKEND)
