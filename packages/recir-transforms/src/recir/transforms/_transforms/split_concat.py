"""``recir-split-concat-products``: a product of a last-axis concatenation as a sum of products of its parts."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from .._graph_util import call_like
from .._step import StepGraph
from .._transform import Transform, TransformResult, register_transform

aten = torch.ops.aten
_LOW_PRECISION = (torch.bfloat16, torch.float16)


@register_transform
class SplitConcatProducts(Transform):
    """Rewrite ``cat([a_1 .. a_n], -1) @ W`` as ``a_1 @ W_1 + .. + a_n @ W_n`` (``W_i``: the rows of ``W``
    that meet ``a_i``), where the concatenation exists only for that product.

    HSTU's output projection ``concat[u, attn, y] @ W_out`` is one. A backend that does not write a
    concatenation in place (XLA on CPUs builds it as a copy, in float32 ahead of a bf16 product) then reads
    the parts where they are. Same multiply-adds; the sum's rounding differs from the single product's
    (float32 accumulation order). A low-precision product (bf16, fp16) keeps its result dtype: the parts'
    products are added in float32 and rounded once, as the single product rounds once.

    Matched: ``aten.cat`` on the last axis whose only reader is a 2-D ``aten.view`` whose only reader is
    ``aten.mm(view, W)`` or ``aten.addmm(bias, view, W)`` (default ``beta``/``alpha``). A concatenation a
    training step also reads for its weight gradient has two readers and is left alone, so this changes
    serving graphs (``to_inference``) and forward-only products.

    Before::

        %cat = aten.cat([%u, %attn, %y], -1)  # forward  float32[16, 194, 192]
        %view = aten.view(%cat, [3104, 192])  # forward
        %mm = aten.mm(%view, %w_t)  # forward  float32[3104, 64]

    After::

        %mm = aten.mm(aten.view(%u, [3104, 64]), aten.slice(%w_t, 0, 0, 64))  # forward
        ... two more products, then %add_1 = aten.add(aten.add(%mm, %mm_1), %mm_2)
    """

    name = "recir-split-concat-products"
    summary = "a product of a last-axis concatenation as a sum of its parts' products"

    @dataclasses.dataclass(frozen=True)
    class Options:
        min_parts: int = 2

    def run(self, step: StepGraph) -> TransformResult:
        graph = step.graph
        split = 0
        for cat in list(graph.find_nodes(op="call_function", target=aten.cat.default)):
            match = _match(cat, self.options.min_parts)
            if match is None:
                continue
            view, product, bias, weight = match
            new = _split(graph, cat.args[0], product, bias, weight)
            product.replace_all_uses_with(new)
            for node in (product, view, cat):
                graph.erase_node(node)
            split += 1
        if split:
            graph.lint()
            step.graph_module.recompile()
        return TransformResult(step, bool(split), {"split": split})


def _val(node: Any) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _match(cat: fx.Node, min_parts: int) -> tuple[fx.Node, fx.Node, fx.Node | None, fx.Node] | None:
    """(view, product, bias, weight) when ``cat`` is a last-axis concatenation read only by one product."""
    parts = cat.args[0]
    out = _val(cat)
    if out is None or not isinstance(parts, (list, tuple)) or len(parts) < min_parts:
        return None
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if not isinstance(dim, int) or dim % out.dim() != out.dim() - 1:
        return None
    vals = [_val(p) for p in parts]
    if any(v is None or v.shape[:-1] != out.shape[:-1] for v in vals):
        return None
    if len(cat.users) != 1:
        return None
    (view,) = cat.users
    if view.target is not aten.view.default or len(view.users) != 1:
        return None
    flat = _val(view)
    if flat is None or flat.dim() != 2 or flat.shape[1] != out.shape[-1]:
        return None
    (product,) = view.users
    if product.kwargs:
        return None
    if product.target is aten.mm.default and len(product.args) == 2 and product.args[0] is view:
        bias, weight = None, product.args[1]
    elif product.target is aten.addmm.default and len(product.args) == 3 and product.args[1] is view:
        bias, weight = product.args[0], product.args[2]
    else:
        return None
    w = _val(weight)
    if w is None or w.dim() != 2 or w.shape[0] != out.shape[-1] or _val(product) is None:
        return None
    return view, product, bias, weight


def _split(
    graph: fx.Graph, parts: list[fx.Node], product: fx.Node, bias: fx.Node | None, weight: fx.Node
) -> fx.Node:
    """The nodes computing ``product`` from ``parts``, inserted before it (with its metadata); returns the sum."""
    out = _val(product)
    assert out is not None
    rows, widen = out.shape[0], out.dtype in _LOW_PRECISION
    start, total = 0, None
    with graph.inserting_before(product):
        for i, part in enumerate(parts):
            k = part.meta["val"].shape[-1]
            if not part.meta["val"].is_contiguous():
                part = call_like(
                    graph, product, aten.clone.default, (part,), {"memory_format": torch.contiguous_format}
                )
            x = call_like(graph, product, aten.view.default, (part, [rows, k]))
            w = call_like(graph, product, aten.slice.Tensor, (weight, 0, start, start + k))
            start += k
            if bias is not None and i == 0:
                term = call_like(graph, product, aten.addmm.default, (bias, x, w))
            else:
                term = call_like(graph, product, aten.mm.default, (x, w))
            if widen:
                term = call_like(graph, product, aten._to_copy.default, (term,), {"dtype": torch.float32})
            total = term if total is None else call_like(graph, product, aten.add.Tensor, (total, term))
        assert total is not None
        if widen:
            total = call_like(graph, product, aten._to_copy.default, (total,), {"dtype": out.dtype})
    return total
