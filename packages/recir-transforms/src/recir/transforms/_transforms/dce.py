"""``recir-cleanup-dce``: remove compute nodes whose values nothing reads (state outputs always stay)."""

from __future__ import annotations

import dataclasses

import torch

from .._step import PHASE_KEY, StepGraph
from .._transform import Transform, TransformResult, register_transform


def is_random(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws random numbers (an op tagged ``nondeterministic_seeded``)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


@register_transform
class DeadCodeElimination(Transform):
    """Remove compute nodes with no users, repeatedly (a dead chain goes in one run).

    Placeholders and the output node are never removed, so every state slot and its new-state output
    survive (a slot nobody reads still has its identity output). Random ops stay unless
    ``drop_random``: with a stateful generator, removing a draw shifts every later draw.

    Before::

        %mm = aten.mm(%x, %w)  # forward
        %relu = aten.relu(%mm)  # forward        <- unused
        %t = aten.t(%relu)  # backward           <- unused once relu is gone... and vice versa
        return [%w, %mm]

    After::

        %mm = aten.mm(%x, %w)  # forward
        return [%w, %mm]
    """

    name = "recir-cleanup-dce"
    summary = "remove compute nodes whose results are never used"

    @dataclasses.dataclass(frozen=True)
    class Options:
        drop_random: bool = False

    def run(self, step: StepGraph) -> TransformResult:
        removed: dict[str, int] = {}
        for node in reversed(list(step.graph.nodes)):
            if node.op != "call_function" or node.users:
                continue
            if is_random(node) and not self.options.drop_random:
                continue
            phase = str(node.meta.get(PHASE_KEY))
            removed[phase] = removed.get(phase, 0) + 1
            step.graph.erase_node(node)
        if removed:
            step.graph_module.recompile()
        return TransformResult(step, bool(removed), {"removed": sum(removed.values()), **removed})
