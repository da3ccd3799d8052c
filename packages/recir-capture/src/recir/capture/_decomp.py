"""The curated decomposition table capture traces with: core ATen, minus the forward-without-backward traps.

A forward decomposition whose extra outputs feed a backward kernel that is not decomposed (the CPU
flash-attention forward returns a logsumexp the fused backward reads) silently corrupts gradients.
Such forwards stay whole; attention is traced through the math SDPA path, whose gradients are exact.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from recir.transforms import CaptureError
from torch._decomp import core_aten_decompositions

#: Forward ops that must never be decomposed unless their backward is (checked by name as well).
FORWARD_BACKWARD_PAIRS: dict[str, str] = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_scaled_dot_product_flash_attention": "aten::_scaled_dot_product_flash_attention_backward",
    "aten::_scaled_dot_product_efficient_attention": "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_scaled_dot_product_cudnn_attention": "aten::_scaled_dot_product_cudnn_attention_backward",
    "aten::_flash_attention_forward": "aten::_flash_attention_backward",
    "aten::_efficient_attention_forward": "aten::_efficient_attention_backward",
    "aten::_weight_norm_interface": "aten::_weight_norm_interface_backward",
    "aten::native_dropout": "aten::native_dropout_backward",
}


#: Ops RecIR transforms pattern-match, kept whole: recir-embedding turns the embedding gradient
#: ``zeros(rows, D).index_add(0, ids, rows)`` (from recir::embedding_bag's backward) into row updates.
KEEP_WHOLE: frozenset[str] = frozenset({"aten::index_add"})


def _qualname(op: Any) -> str:
    return op._schema.name if isinstance(op, torch._ops.OpOverload) else str(op)


def _implicit_pairs(table: Mapping[Any, Any]) -> dict[str, str]:
    """Multi-output forwards ``X`` in ``table`` that have an ``X_backward`` op (their aux outputs feed it)."""
    pairs = {}
    for op in table:
        if not isinstance(op, torch._ops.OpOverload) or len(op._schema.returns) < 2:
            continue
        name = op._schema.name
        ns, base = name.split("::")
        if hasattr(getattr(torch.ops, ns), base + "_backward"):
            pairs[name] = f"{ns}::{base}_backward"
    return pairs


def check_decomposition_table(table: Mapping[Any, Any]) -> None:
    """Raise CaptureError if ``table`` decomposes a forward op but not its backward."""
    decomposed = {_qualname(op) for op in table}
    pairs = {**_implicit_pairs(table), **FORWARD_BACKWARD_PAIRS}
    bad = sorted(f for f, b in pairs.items() if f in decomposed and b not in decomposed)
    if bad:
        raise CaptureError(
            f"the decomposition table decomposes forward op(s) {bad} but not their backward; the "
            "decomposed forward's auxiliary outputs would feed the fused backward kernel and corrupt "
            "gradients.\nFix: decompose each forward only together with its backward (or neither)."
        )


@functools.cache
def _capture_decompositions() -> dict[Any, Any]:
    table = dict(core_aten_decompositions())
    decomposed = {_qualname(op) for op in table}
    pairs = {**_implicit_pairs(table), **FORWARD_BACKWARD_PAIRS}
    for op in list(table):
        name = _qualname(op)
        if name in KEEP_WHOLE:
            del table[op]
        elif name in pairs and pairs[name] not in decomposed:
            del table[op]  # keep the fused forward whole, next to its fused backward
        elif isinstance(op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.tags:
            del table[op]  # random ops stay visible so capture can route or reject them
    check_decomposition_table(table)
    return table


def capture_decompositions() -> dict[Any, Any]:
    """A copy of the table capture uses (core ATen decompositions minus the unsafe forwards)."""
    return dict(_capture_decompositions())
