"""Let Inductor free a buffer after its last reader, not after the in-place update of what it read.

A compiled step updates its state in place (``GPUOptions.in_place``): the new value of a parameter is
written into the parameter's own storage. Inductor orders each such write after every kernel that read
the old value, and it does so with a dependency on each *output buffer* of those kernels (a ``WeakDep``
naming the mutated buffer). That dependency also counts as a use when Inductor decides where to free a
buffer, so every buffer computed from a parameter in the forward stays alive until that parameter's
update at the end of the backward. For a step that keeps its activations anyway it costs little; for a
step rewritten to recompute them (recir-recompute-activations) it undoes much of the saving: at full-size
DLRMv3, UIH 4096, Inductor kept 1283 MiB where the graph's own liveness needs 878 (each STU layer's
``uvqk`` product, its ``concat[u, attn, y]`` and its output projection stayed alive until the layer's
Adam update).

:class:`FreeEarly` runs between Inductor's dependency analysis and fusion and marks those dependencies
as ordering-only (``WeakDep(is_fake=True)``, the form Inductor's own communication reordering uses):
the update still runs after every reader, and buffers are freed after their last real reader.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Imported only by GPUOptions.inductor_patches, so Inductor's scheduler modules load with the compile.
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.dependencies import WeakDep
from torch.utils._ordered_set import OrderedSet


class FreeEarly(CustomGraphPass):
    """An Inductor ``_pre_fusion_custom_pass``: mutation-ordering dependencies stop extending lifetimes.

    A ``CustomGraphPass`` with a fixed ``uuid``, so Inductor's FX graph cache keys it (a plain callable
    would bypass the cache)."""

    def __call__(self, nodes: list[Any]) -> list[Any]:  # type: ignore[override]
        for node in nodes:
            for snode in {id(n): n for n in (node, *node.get_nodes())}.values():
                _order_only(snode)
        return nodes

    def uuid(self) -> str:
        return "recir-gpu-free-early-v1"


def _order_only(snode: Any) -> None:
    swap = {
        dep: dataclasses.replace(dep, is_fake=True)
        for dep in snode.read_writes.reads
        if isinstance(dep, WeakDep) and not dep.is_fake and dep.mutating_buf
    }
    if swap:
        snode.read_writes = snode.read_writes.remove_reads(OrderedSet(swap)).with_read(
            OrderedSet(swap.values())
        )
        snode.unmet_dependencies = OrderedSet(swap.get(d, d) for d in snode.unmet_dependencies)
