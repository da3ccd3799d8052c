"""``recir-cleanup-cse``: merge identical pure computations within one phase (never random ops or collectives)."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from .._graph_util import alias_chain
from .._step import OVERRIDE_KEY, PHASE_KEY, PHASES, REGION_KEY, SHARDING_KEY, StepGraph
from .._transform import Transform, TransformResult, register_transform
from .dce import is_random

# Namespaces whose ops are never merged: collectives are scheduled by recir-distributed.
_NO_CSE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")


class _Unhashable(Exception):
    pass


def _key_arg(a: Any, rep: dict[fx.Node, fx.Node]) -> Any:
    if isinstance(a, fx.Node):
        return ("%", rep.get(a, a))
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_key_arg(x, rep) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple(sorted((k, _key_arg(v, rep)) for k, v in a.items())))
    if a is None or isinstance(
        a, (bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)
    ):
        # the type and repr keep 1/True/1.0 and 0.0/-0.0 apart
        return (type(a).__name__, repr(a))
    raise _Unhashable


@register_transform
class CommonSubexpressionElimination(Transform):
    """Replace a node by an earlier identical one (same op, same inputs, same literal arguments).

    What is never merged, and why:

    - nodes of different phases (unless ``cross_phase``): a backward copy of a forward value is how
      activation recomputation trades compute for memory, and phase_split needs each phase whole;
      with ``cross_phase`` a node may reuse an identical node of an *earlier* phase;
    - nodes with different ``recir.region``, ``recir.sharding`` or ``recir.override`` metadata;
    - random ops (``nondeterministic_seeded``): two draws are two different values;
    - functional collectives: recir-distributed owns their schedule;
    - two nodes that both reach graph outputs through views when one is new state (INV-2: each
      state slot needs its own buffer).

    Before::

        %mm = aten.mm(%x, %w)  # forward
        %mm_1 = aten.mm(%x, %w)  # forward
        %add = aten.add.Tensor(%mm, %mm_1)  # forward

    After::

        %mm = aten.mm(%x, %w)  # forward
        %add = aten.add.Tensor(%mm, %mm)  # forward
    """

    name = "recir-cleanup-cse"
    summary = "merge identical pure computations of the same phase"

    @dataclasses.dataclass(frozen=True)
    class Options:
        cross_phase: bool = False

    def run(self, step: StepGraph) -> TransformResult:
        graph = step.graph
        n_state = len(step.signature.state)
        out_chain: dict[fx.Node, set[int]] = {}
        for i, value in enumerate(graph.output_node().args[0]):
            for node in alias_chain(value):  # the output and every tensor it is a view of
                out_chain.setdefault(node, set()).add(i)
        rank = {p: i for i, p in enumerate(PHASES)}
        seen: dict[Any, fx.Node] = {}
        rep: dict[fx.Node, fx.Node] = {}
        merged: dict[str, int] = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or not self._mergeable(node):
                continue
            try:
                key = (
                    str(node.target),
                    _key_arg(node.args, rep),
                    _key_arg(dict(node.kwargs), rep),
                    None if self.options.cross_phase else node.meta.get(PHASE_KEY),
                    repr(node.meta.get(REGION_KEY)),
                    repr(node.meta.get(SHARDING_KEY)),
                    node.meta.get(OVERRIDE_KEY),
                )
            except _Unhashable:
                continue
            other = seen.get(key)
            if other is None:
                seen[key] = node
                continue
            if rank.get(other.meta.get(PHASE_KEY), 0) > rank.get(node.meta.get(PHASE_KEY), 0):
                continue  # never make an earlier phase wait for a later one (INV-5)
            a, b = out_chain.get(other, set()), out_chain.get(node, set())
            if a and b and any(i < n_state for i in a | b):
                continue  # two outputs would share one buffer, one of them state (INV-2)
            node.replace_all_uses_with(other)
            rep[node] = other
            out_chain.setdefault(other, set()).update(b)
            phase = str(node.meta.get(PHASE_KEY))
            merged[phase] = merged.get(phase, 0) + 1
            graph.erase_node(node)
        if merged:
            step.graph_module.recompile()
        return TransformResult(step, bool(merged), {"merged": sum(merged.values()), **merged})

    @staticmethod
    def _mergeable(node: fx.Node) -> bool:
        target = node.target
        if target is operator.getitem:
            return True
        if not isinstance(target, torch._ops.OpOverload):
            return False
        if target.namespace in _NO_CSE_NAMESPACES or target._schema.is_mutable:
            return False
        return not is_random(node)
