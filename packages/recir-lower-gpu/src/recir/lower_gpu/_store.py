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


def store_rng_masks(gm: fx.GraphModule) -> int:
    """Route every read of a ``recir.rng_mask`` node through ``recir::store``; returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.meta.get(RNG_MASK_KEY) is None or not node.users:
            continue
        with gm.graph.inserting_after(node):
            stored = gm.graph.call_function(torch.ops.recir.store.default, (node,))
        stored.meta = {k: v for k, v in node.meta.items() if k != RNG_MASK_KEY}
        stored.meta[OVERRIDE_KEY] = STORE_OVERRIDE
        for user in [u for u in node.users if u is not stored]:
            user.replace_input_with(node, stored)
        count += 1
    if count:
        gm.recompile()
    return count
