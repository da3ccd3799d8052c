"""``recir-dist-fold-rng-rank``: give every data-parallel rank its own random stream by folding its data
index into the ``rng:seed`` the step reads; the stored ``rng:seed`` state stays the same on all ranks.

Before::                                      After (data index 1)::

    %k = bitwise_and(%rng_seed, 4294967295)       %s = bitwise_and(%rng_seed, 4294967295)  # forward
    ...                                           %s1 = add(%s, 2654435769)  # forward
    return [..., %rng_seed, %offset2, ...]        %seed1 = bitwise_and(%s1, 4294967295)  # forward
                                                  %k = bitwise_and(%seed1, 4294967295)
                                                  return [..., %rng_seed, %offset2, ...]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.fx as fx
from recir.transforms import (
    PHASE_KEY,
    RNG_SEED_SLOT,
    SHARDING_KEY,
    StepGraph,
    TransformResult,
    register_transform,
)

from .._graphinfo import source_of, state_placeholders
from .._rewrite import call, repropagate
from ._common import PlanTransform

M32 = 0xFFFFFFFF
# Odd 32-bit constant (2**32 / golden ratio): seed + i * GOLDEN differs mod 2**32 for every i < 2**32.
GOLDEN = 0x9E3779B9


def data_index(plan: object, rank: int) -> int:
    """``rank``'s coordinate along the plan mesh's ``data`` axis (0 when the mesh has none)."""
    mesh = plan.mesh  # type: ignore[attr-defined]
    return mesh.coords(rank).get("data", 0) if "data" in mesh.axes else 0


def folded_seed_delta(index: int) -> int:
    """What data index ``index`` adds (mod 2**32) to the seed its random ops read."""
    return (index * GOLDEN) & M32


@register_transform
class FoldRngRank(PlanTransform):
    name: ClassVar[str] = "recir-dist-fold-rng-rank"
    summary: ClassVar[str] = (
        "random ops read rng:seed + data_index * 0x9E3779B9 (mod 2**32): independent per-rank streams, "
        "the stored seed stays identical on every rank"
    )
    count_stat: ClassVar[str] = "folded"

    def targets(self, step: StepGraph) -> list[str]:
        names = [s.name for s in step.signature.state]
        return [RNG_SEED_SLOT] if self.options.plan.mesh.data_size > 1 and RNG_SEED_SLOT in names else []

    def rewrite(self, step: StepGraph, targets: Sequence[str]) -> TransformResult:
        plan, rank = self.options.plan, self.options.rank
        names = [s.name for s in step.signature.state]
        index = data_index(plan, rank)
        graph = step.graph
        seed = state_placeholders(step)[RNG_SEED_SLOT]
        out = next(n for n in graph.nodes if n.op == "output")
        values = list(out.args[0])
        pos = names.index(RNG_SEED_SLOT)
        if source_of(values[pos]) is seed:  # the pass-through (maybe via detach/alias) returns the input
            values[pos] = seed
            out.args = (tuple(values),)
        readers = [u for u in seed.users if u is not out]
        others_in_out = [i for i, v in enumerate(values) if v is seed and i != pos]
        if not readers and not others_in_out:
            return TransformResult(step, False, {"folded": 0})
        first = min(readers, key=_position(graph)) if readers else out
        phase = first.meta.get(PHASE_KEY, "forward")
        with graph.inserting_before(first):
            low = call(graph, torch.ops.aten.bitwise_and.Scalar, seed, M32, phase=phase)
            moved = call(graph, torch.ops.aten.add.Tensor, low, folded_seed_delta(index), phase=phase)
            folded = call(graph, torch.ops.aten.bitwise_and.Scalar, moved, M32, phase=phase)
        for node in (low, moved, folded):
            node.meta[SHARDING_KEY] = {"placement": "replicate", "role": "rng", "data_index": index}
        for user in readers:
            user.replace_input_with(seed, folded)
        if others_in_out:
            values = [folded if i in others_in_out else v for i, v in enumerate(values)]
            out.args = (tuple(values),)
        repropagate(step, self.name)
        return TransformResult(step, True, {"folded": len(readers), "data_index": index})


def _position(graph: fx.Graph):  # noqa: ANN202
    order = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: order[n]
