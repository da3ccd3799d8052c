"""The ``recir::ring_shift_*`` graph ops: lookups of row-sharded tables that recir.lower_tpu lowers to
its ring shift (ids travel a device ring, each device gathers the rows it owns with a Pallas kernel).
This package only marks them; it never imports JAX.
"""

from __future__ import annotations

import torch
from recir.transforms import embedding_bag_reference, register_override_op
from torch import Tensor

# -- graph ops: the lookups prepare_for_lowering(backend="ring_shift") puts in a StepGraph ----------------
RING_SHIFT_BACKEND = "recir-embedding-ring_shift"


def ring_shift_embedding_bag_reference(
    weight: Tensor, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None, mode: int, axis: str
) -> Tensor:
    """Pure-ATen form (``recir::embedding_bag``'s reference); ``axis`` only matters to the JAX lowering."""
    del axis
    return embedding_bag_reference(weight, indices, offsets, per_sample_weights, mode)


def ring_shift_embedding_reference(weight: Tensor, ids: Tensor, axis: str) -> Tensor:
    """Pure-ATen form: ``weight[ids]``."""
    del axis
    return weight.index_select(0, ids)


@torch.library.custom_op("recir::ring_shift_embedding_bag", mutates_args=())
def ring_shift_embedding_bag(
    weight: Tensor, indices: Tensor, offsets: Tensor, per_sample_weights: Tensor | None, mode: int, axis: str
) -> Tensor:
    """``recir::embedding_bag`` of a table row-sharded over mesh axis ``axis`` (forward only).

    Eagerly the plain lookup; recir.lower_tpu lowers it to ``ring_shift_lookup`` plus per-bag pooling.
    """
    return ring_shift_embedding_bag_reference(weight, indices, offsets, per_sample_weights, mode, axis)


@ring_shift_embedding_bag.register_fake
def _ring_bag_fake(weight, indices, offsets, per_sample_weights, mode, axis):
    return weight.new_empty(offsets.shape[0] - 1, weight.shape[1])


@torch.library.custom_op("recir::ring_shift_embedding", mutates_args=())
def ring_shift_embedding(weight: Tensor, ids: Tensor, axis: str) -> Tensor:
    """``weight[ids]`` of a row-sharded table or row-wise optimizer state (forward only): a sequence
    lookup, or the sparse row update's read of the touched rows."""
    return ring_shift_embedding_reference(weight, ids, axis)


@ring_shift_embedding.register_fake
def _ring_emb_fake(weight, ids, axis):
    return weight.new_empty(ids.shape[0], *weight.shape[1:])


def ring_shift_index_add_reference(weight: Tensor, ids: Tensor, updates: Tensor, axis: str) -> Tensor:
    """Pure-ATen form: ``weight.index_put((ids,), updates, accumulate=True)``."""
    del axis
    return weight.index_put((ids,), updates, accumulate=True)


@torch.library.custom_op("recir::ring_shift_index_add", mutates_args=())
def ring_shift_index_add(weight: Tensor, ids: Tensor, updates: Tensor, axis: str) -> Tensor:
    """The sparse row update's write of a row-sharded table or its row-wise optimizer state: ``updates``
    added to rows ``ids`` (a new tensor); recir.lower_tpu scatter-adds them into the owner shards."""
    return ring_shift_index_add_reference(weight, ids, updates, axis)


@ring_shift_index_add.register_fake
def _ring_index_add_fake(weight, ids, updates, axis):
    return torch.empty_like(weight)


for _op in ("ring_shift_embedding_bag", "ring_shift_embedding", "ring_shift_index_add"):
    register_override_op(f"recir::{_op}", RING_SHIFT_BACKEND)
