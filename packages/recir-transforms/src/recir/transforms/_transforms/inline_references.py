"""``recir-override-inline-references``: chosen ``recir::*`` ops replaced by their pure-ATen references.

For a lowering whose compiler should see into an override op (Inductor fusing HSTU attention's
elementwise work around its products) instead of calling the op's kernel at a graph boundary.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .._errors import ConfigError
from .._override import reference_for
from .._region import splice
from .._step import PHASE_KEY, SCOPE_KEY, StepGraph
from .._transform import Transform, TransformResult, register_transform


def _qualname(target: object) -> str | None:
    return target._schema.name if isinstance(target, torch._ops.OpOverload) else None


def _bound(ref: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Callable[..., Any], list[fx.Node]]:
    """``ref`` as a function of the node arguments that are graph values; the others (ints, floats,
    lists of ints, None) bound as the node has them."""
    nodes = [a for a in args if isinstance(a, fx.Node)]
    positions = [i for i, a in enumerate(args) if isinstance(a, fx.Node)]

    def fn(*xs: torch.Tensor) -> Any:
        full = list(args)
        for i, x in zip(positions, xs):
            full[i] = x
        out = ref(*full)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    return fn, nodes


@register_transform
class InlineReferences(Transform):
    """Replace each node of the ``ops`` (qualified names, ``recir::hstu_attention``) by its reference's
    ATen nodes, traced on the node's values; the new nodes keep its phase and module scope. An op with
    a tuple output has its ``getitem`` readers rewired to the matching outputs.

    Before::

        %attn = recir.hstu_attention(%q, %k, %v, %valid, %scale, 66, 0.088, [0, 66])  # forward

    After::

        %mul = aten.mul(%k_prefix, %keep)  # forward
        ... %bmm = aten.bmm(...) ...        # forward: the reference's nodes
        %attn = aten.mul(%add, %keep)      # forward
    """

    name = "recir-override-inline-references"
    summary = "replace chosen recir:: ops by their pure-ATen references"

    @dataclasses.dataclass(frozen=True)
    class Options:
        ops: tuple[str, ...] = ()

    def run(self, step: StepGraph) -> TransformResult:
        wanted = set(self.options.ops)
        inlined: dict[str, int] = {}
        for node in list(step.graph.nodes):
            qualname = _qualname(node.target) if node.op == "call_function" else None
            if qualname is None or qualname not in wanted:
                continue
            ref = reference_for(node.target)  # type: ignore[arg-type]
            if ref is None:
                raise ConfigError(
                    f"{self.name}: {qualname} has no pure-ATen reference (node %{node.name}). Fix: define "
                    f"`{qualname.split('::')[1]}_reference` beside the op's custom_op definition"
                )
            fn, args = _bound(ref, tuple(node.args))
            before = node.prev
            new = splice(
                step.graph,
                fn,
                args,
                before=node,
                phase=node.meta.get(PHASE_KEY, "forward"),
                provenance=self.name,
            )
            if SCOPE_KEY in node.meta:
                cursor = before.next
                while cursor is not node:  # splice's nodes: between the old predecessor and the op
                    cursor.meta.setdefault(SCOPE_KEY, node.meta[SCOPE_KEY])
                    cursor = cursor.next
            _rewire(node, new)
            inlined[qualname] = inlined.get(qualname, 0) + 1
        if inlined:
            step.graph.eliminate_dead_code()
            step.graph_module.recompile()
        return TransformResult(step, bool(inlined), {"inlined": sum(inlined.values()), **inlined})


def _rewire(node: fx.Node, outputs: list[fx.Node]) -> None:
    if len(outputs) == 1 and not any(u.target is operator.getitem for u in node.users):
        node.replace_all_uses_with(outputs[0])
    else:
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise ConfigError(
                    f"recir-override-inline-references: %{node.name} returns a tuple but %{user.name} reads "
                    f"it whole; only getitem readers can be rewired"
                )
            user.replace_all_uses_with(outputs[user.args[1]])  # type: ignore[index]
    for user in list(node.users):
        node.graph.erase_node(user)
    node.graph.erase_node(node)
