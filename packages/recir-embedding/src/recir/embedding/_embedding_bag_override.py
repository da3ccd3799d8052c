"""EmbeddingBagOverride: ``torch.nn.EmbeddingBag`` -> the opaque ``recir::embedding_bag`` op.

The stand-in keeps the table as the same ``weight`` parameter (so the state slot stays
``param:<path>.weight``) and normalises the three input forms (2-D, 1-D + offsets, include_last_offset)
to ``(indices, offsets[B+1])``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from recir.transforms import CaptureError, Override
from torch import Tensor, nn


class EmbeddingBagStandIn(nn.Module):
    """Calls ``torch.ops.recir.embedding_bag`` with the original table."""

    def __init__(self, original: nn.EmbeddingBag, path: str) -> None:
        super().__init__()
        self.weight = original.weight
        self.mode = 0 if original.mode == "sum" else 1
        self.include_last_offset = original.include_last_offset
        self.path = path

    def forward(
        self, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None
    ) -> Tensor:
        if input.dim() == 2:
            bags, length = input.shape
            indices = input.reshape(-1)
            offsets = torch.arange(0, (bags + 1) * length, length, dtype=indices.dtype, device=indices.device)
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights.reshape(-1)
        elif input.dim() == 1:
            if offsets is None:
                raise CaptureError(
                    f"EmbeddingBag {self.path!r} got 1-D input without offsets.\n"
                    "Fix: pass offsets (or a 2-D [bags, length] input)."
                )
            indices = input
            offsets = offsets.to(indices.dtype)
            if not self.include_last_offset:
                end = offsets.new_full((1,), indices.shape[0])
                offsets = torch.cat([offsets, end])
        else:
            raise CaptureError(f"EmbeddingBag {self.path!r}: input must be 1-D or 2-D, got {input.dim()}-D")
        if per_sample_weights is not None and self.mode != 0:
            raise CaptureError(
                f"EmbeddingBag {self.path!r}: per_sample_weights needs mode='sum' (as torch requires)."
            )
        return torch.ops.recir.embedding_bag(self.weight, indices, offsets, per_sample_weights, self.mode)


class EmbeddingBagOverride(Override):
    """Swap ``nn.EmbeddingBag`` (sum/mean; no max_norm, padding_idx or scale_grad_by_freq) for the op.

    Unsupported configurations are left alone and traced as plain ATen ``embedding_bag``.
    """

    name: ClassVar[str] = "recir-embedding-bag"
    ops: ClassVar[tuple[str, ...]] = ("recir::embedding_bag",)

    def matches(self, module: nn.Module) -> bool:
        return (
            isinstance(module, nn.EmbeddingBag)
            and module.mode in ("sum", "mean")
            and module.max_norm is None
            and module.padding_idx is None
            and not module.scale_grad_by_freq
        )

    def replace(self, module: nn.Module, path: str) -> nn.Module:
        assert isinstance(module, nn.EmbeddingBag)
        return EmbeddingBagStandIn(module, path)
