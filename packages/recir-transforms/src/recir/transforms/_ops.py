"""RecIR's core opaque ops (``recir::*``): custom ops with fake implementations and gradient formulas.

They stand at graph boundaries for kernels a compiler must not see into (FBGEMM TBE, TorchRec),
and each has a pure-ATen reference (``*_reference``) that in-graph backends and lowerings may use.

Why the recommendation op ``recir::embedding_bag`` lives in this generic, torch-only leaf rather than in
recir-embedding (whose ``EmbeddingBagOverride`` emits it for a plain ``nn.EmbeddingBag``, and whose TorchRec
and TBE stand-ins do too): every StepGraph holding one must run in the reference interpreter and pass the
verifier with only recir-transforms installed (the downstream teams that depend on it alone, and
recir-capture, which captures and verifies such graphs without importing recir-embedding). recir-embedding
owns everything built on it: the override, the backends' kernels, sparse updates, quantised tables,
TorchRec's ops (``recir::embedding`` and the rest are registered there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._override import register_override_op

EMBEDDING_BAG_MODES = ("sum", "mean")


def bag_segment_ids(offsets: Tensor, num_indices: int) -> Tensor:
    """For each of ``num_indices`` ids, the bag it belongs to (offsets has B+1 entries, or B without the last
    offset: the last bag then takes the rest). Static shape.

    The whole ``offsets`` is searched (offsets[0] is 0, so every position counts it once) rather than the
    view ``offsets[1:]``: Inductor's Triton searchsorted cannot read a slice of a computed buffer (torch
    2.11 on CUDA: ``NotImplementedError: SliceView``)."""
    positions = torch.arange(num_indices, device=offsets.device, dtype=offsets.dtype)
    return (torch.searchsorted(offsets, positions, right=True) - 1).clamp_min(0)


def embedding_bag_reference(
    weight: Tensor, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None, mode: int
) -> Tensor:
    """Pure-ATen pooled lookup: bag b pools ``weight[indices[offsets[b]:offsets[b+1]]]``."""
    num_bags = offsets.shape[0] - 1
    seg = bag_segment_ids(offsets, indices.shape[0])
    rows = weight.index_select(0, indices)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(1).to(rows.dtype)
    pooled = rows.new_zeros(num_bags, weight.shape[1]).index_add(0, seg, rows)
    if mode == 1:
        lengths = (offsets[1:] - offsets[:-1]).clamp(min=1).to(pooled.dtype)
        pooled = pooled / lengths.unsqueeze(1)
    return pooled


@torch.library.custom_op("recir::embedding_bag", mutates_args=())
def embedding_bag(
    weight: Tensor, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None, mode: int
) -> Tensor:
    """Pooled embedding lookup. ``offsets`` has B+1 entries; ``mode`` 0 = sum, 1 = mean.

    ``per_sample_weights`` scales each id's row (sum mode only); a weight of 0 makes a padding id inert.
    """
    if mode not in (0, 1):
        raise ValueError(f"recir::embedding_bag: mode must be 0 (sum) or 1 (mean), got {mode}")
    if per_sample_weights is not None and mode != 0:
        raise ValueError("recir::embedding_bag: per_sample_weights needs mode 0 (sum)")
    return F.embedding_bag(
        indices,
        weight,
        offsets,
        mode=EMBEDDING_BAG_MODES[mode],
        per_sample_weights=per_sample_weights,
        include_last_offset=True,
    )


@embedding_bag.register_fake
def _embedding_bag_fake(weight, indices, offsets, per_sample_weights, mode):
    return weight.new_empty(offsets.shape[0] - 1, weight.shape[1])


def _embedding_bag_setup_context(ctx, inputs, output):
    weight, indices, offsets, per_sample_weights, mode = inputs
    ctx.mode = mode
    ctx.num_rows = weight.shape[0]
    ctx.save_for_backward(
        weight if per_sample_weights is not None else None, indices, offsets, per_sample_weights
    )


def _embedding_bag_backward(ctx, grad):
    weight, indices, offsets, per_sample_weights = ctx.saved_tensors
    seg = bag_segment_ids(offsets, indices.shape[0])
    per_id = grad.index_select(0, seg)
    if ctx.mode == 1:
        lengths = (offsets[1:] - offsets[:-1]).clamp(min=1).to(grad.dtype)
        per_id = per_id / lengths.index_select(0, seg).unsqueeze(1)
    grad_psw = None
    if per_sample_weights is not None:
        grad_psw = (per_id * weight.index_select(0, indices)).sum(1).to(per_sample_weights.dtype)
        per_id = per_id * per_sample_weights.unsqueeze(1).to(per_id.dtype)
    # Dense gradient as zeros.index_add(ids, per-id rows): recir-embedding's sparse-update transform
    # recognises this pattern and turns it (with the optimizer) into row-wise updates.
    grad_weight = per_id.new_zeros(ctx.num_rows, grad.shape[1]).index_add(0, indices, per_id)
    return grad_weight, None, None, grad_psw, None


embedding_bag.register_autograd(_embedding_bag_backward, setup_context=_embedding_bag_setup_context)
register_override_op("recir::embedding_bag", "recir-embedding-bag")
