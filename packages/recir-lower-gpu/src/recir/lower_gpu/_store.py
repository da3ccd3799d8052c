"""Store a value once instead of letting Inductor recompute it in every consumer.

Inductor inlines a pointwise value into each kernel that reads it unless its expression is long
(``realize_opcount_threshold``). A dropout keep mask is a ~20-op counter hash read by the forward and
again by the backward, so each reader recomputes the hash over every element (on an H200, a quarter of
the DLRMv3 step's GPU time sat in kernels that recompute it; on the CPU, storing measured slower:
``GPUOptions.store_rng_masks`` is off by default). ``recir::store(x)`` is the identity whose
Inductor lowering realizes ``x`` into a buffer: the hash runs once and its readers load one byte per
element. :func:`store_rng_masks` puts it after every node recir-capture tagged ``recir.rng_mask``.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
from recir.transforms import OVERRIDE_KEY, RNG_MASK_KEY, register_override_op
from torch import Tensor


@torch.library.custom_op("recir::store", mutates_args=())
def store(x: Tensor) -> Tensor:
    """The identity (a copy: custom ops may not alias their inputs); Inductor stores ``x`` once."""
    return x.clone()


@store.register_fake
def _store_fake(x: Tensor) -> Tensor:
    return torch.empty_like(x)


# an opaque op the verifier accepts (INV-6): the rewrite is a Transform in the lowering's pipeline
STORE_OVERRIDE = "recir-gpu-store-rng-masks"
register_override_op("recir::store", STORE_OVERRIDE)


@functools.cache
def register_inductor_lowering() -> None:
    """Lower ``recir::store`` to "realize the input" (the first compile registers it)."""
    from torch._inductor.lowering import register_lowering

    @register_lowering(torch.ops.recir.store.default)
    def _lower_store(x):  # type: ignore[no-untyped-def]
        x.realize()
        return x


_UINT = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


def expand_recompute_barriers(gm: fx.GraphModule) -> int:
    """Replace each ``recir::recompute_barrier`` (recir-recompute-activations) by what keeps Inductor from
    computing the copies early or fusing them into their forward twins: every entry ORs in a zero read
    from the backward value the barrier waits for (bit-exact; no compiler can prove the zero). Returns
    how many barriers were expanded."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.target is not torch.ops.recir.recompute_barrier.default:
            continue
        xs = list(node.args[0])
        with gm.graph.inserting_before(node):
            if len(xs) > 1:
                first, val = xs[-1], xs[-1].meta["val"]
                while val.dim():  # its first element, as a 0-d tensor
                    first = gm.graph.call_function(torch.ops.aten.select.int, (first, 0, 0))
                    val = val.select(0, 0)
                    first.meta.update(node.meta, val=val)
                small = gm.graph.call_function(
                    torch.ops.aten._to_copy.default, (first,), {"dtype": torch.uint8}
                )
                zero = gm.graph.call_function(torch.ops.aten.clamp_max.default, (small, 0))
                small.meta.update(node.meta, val=val.to(torch.uint8))
                zero.meta.update(node.meta, val=small.meta["val"])
            outs = [
                _or_zero(gm.graph, x, zero, node) if len(xs) > 1 and i < len(xs) - 1 else x
                for i, x in enumerate(xs)
            ]
        for user in list(node.users):
            user.replace_all_uses_with(outs[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count


def _or_zero(graph: fx.Graph, x: fx.Node, zero: fx.Node, barrier: fx.Node) -> fx.Node:
    val = x.meta["val"]
    aten = torch.ops.aten
    if val.dtype == torch.bool:
        nonzero = graph.call_function(aten.gt.Scalar, (zero, 0))
        nonzero.meta.update(barrier.meta, val=zero.meta["val"] > 0)
        out = graph.call_function(aten.bitwise_or.Tensor, (x, nonzero))
        out.meta.update(barrier.meta, val=val.clone())
        return out
    bits = _UINT[val.element_size()] if val.is_floating_point() else val.dtype
    as_bits = graph.call_function(aten.view.dtype, (x, bits)) if bits != val.dtype else x
    z = graph.call_function(aten._to_copy.default, (zero,), {"dtype": bits})
    ored = graph.call_function(aten.bitwise_or.Tensor, (as_bits, z))
    out = graph.call_function(aten.view.dtype, (ored, val.dtype)) if bits != val.dtype else ored
    for n, v in (
        (as_bits, val.view(bits)),
        (z, zero.meta["val"].to(bits)),
        (ored, val.view(bits)),
        (out, val),
    ):
        if n is not x:  # integer entries are their own bits
            n.meta.update(barrier.meta, val=v)
    return out


def _store_after(graph: fx.Graph, node: fx.Node) -> None:
    """Every reader of ``node`` reads ``recir::store(node)`` instead."""
    with graph.inserting_after(node):
        stored = graph.call_function(torch.ops.recir.store.default, (node,))
    stored.meta = {k: v for k, v in node.meta.items() if k != RNG_MASK_KEY}
    stored.meta[OVERRIDE_KEY] = STORE_OVERRIDE
    for user in [u for u in node.users if u is not stored]:
        user.replace_input_with(node, stored)


def store_rng_masks(gm: fx.GraphModule) -> int:
    """Route every read of a ``recir.rng_mask`` node through ``recir::store``; returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.meta.get(RNG_MASK_KEY) is None or not node.users:
            continue
        _store_after(gm.graph, node)
        count += 1
    if count:
        gm.recompile()
    return count


# Views Inductor computes by indexing (a read through them is a read of their input).
_VIEWS = {
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.expand.default,
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.select.int,
    torch.ops.aten._to_copy.default,  # a cast, fused into each reader like a view
}


def _readers(node: fx.Node) -> int:
    """How many non-view nodes read ``node``, directly or through views and casts."""
    count = 0
    for user in node.users:
        if user.op == "call_function" and user.target in _VIEWS:
            count += _readers(user)
        else:
            count += 1
    return count


def store_shared_masks(gm: fx.GraphModule, min_readers: int = 3, min_numel: int = 1 << 16) -> int:
    """Route every boolean value of at least ``min_numel`` elements that at least ``min_readers`` nodes
    read (through views and casts) through ``recir::store``, so Inductor computes it once instead of in
    every kernel that reads it. Returns how many. Values already stored, views and casts are skipped
    (the value they read is the one to store), and so are dropout masks (``store_rng_masks`` decides)."""
    count = 0
    for node in list(gm.graph.nodes):
        val = node.meta.get("val")
        if (
            node.op != "call_function"
            or node.target in _VIEWS
            or node.target is torch.ops.recir.store.default
            or node.meta.get(RNG_MASK_KEY) is not None  # dropout masks: GPUOptions.store_rng_masks
            or not isinstance(val, Tensor)
            or val.dtype != torch.bool
            or val.numel() < min_numel
            or any(u.target is torch.ops.recir.store.default for u in node.users)
            or _readers(node) < min_readers
        ):
            continue
        _store_after(gm.graph, node)
        count += 1
    if count:
        gm.recompile()
    return count
