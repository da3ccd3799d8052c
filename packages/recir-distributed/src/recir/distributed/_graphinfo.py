"""Read-only facts about a StepGraph that planning and the transforms share: slot placeholders,
gradient nodes (``recir.grad_of``), embedding-table lookups, and which optimizer slots follow a parameter.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from recir.transforms import GRAD_OF_KEY, ConfigError, StateSlot, StepGraph, grad_nodes, slot_path


def lookup_ops() -> tuple[object, ...]:
    """The pooled/unpooled ``recir::*`` lookups whose weight is an embedding table."""
    ops: list[object] = [torch.ops.recir.embedding_bag.default]
    if hasattr(torch.ops.recir, "embedding"):
        ops.append(torch.ops.recir.embedding.default)
    return tuple(ops)


_IDENTITY = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def source_of(node: object) -> object:
    """Follow ``detach``/``alias`` back to the tensor they return unchanged (often a placeholder)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _IDENTITY:
        node = node.args[0]
    return node


def aliases_of(node: fx.Node) -> list[fx.Node]:
    """``node`` and every ``detach``/``alias`` chain hanging off it."""
    out, todo = [node], [node]
    while todo:
        for user in todo.pop().users:
            if user.op == "call_function" and user.target in _IDENTITY:
                out.append(user)
                todo.append(user)
    return out


def state_placeholders(step: StepGraph) -> dict[str, fx.Node]:
    """State slot name -> its placeholder node."""
    phs = [n for n in step.graph.nodes if n.op == "placeholder"]
    return {slot.name: node for slot, node in zip(step.signature.state, phs)}


def batch_placeholders(step: StepGraph) -> dict[str, fx.Node]:
    phs = [n for n in step.graph.nodes if n.op == "placeholder"][len(step.signature.state) :]
    return {slot.name: node for slot, node in zip(step.signature.batch, phs)}


def table_slots(step: StepGraph) -> list[str]:
    """Param slots that a ``recir::*`` lookup reads as its weight (shardable tables), in signature order.

    Weights of plain ATen lookups (a small ``nn.Embedding`` captured without an override) are dense
    parameters: they are replicated or FSDP-sharded like any other.
    """
    phs = state_placeholders(step)
    by_node = {node: name for name, node in phs.items()}
    found: set[str] = set()
    ops = lookup_ops()
    for node in step.graph.nodes:
        if node.op == "call_function" and node.target in ops:
            weight = source_of(node.args[0])
            if isinstance(weight, fx.Node) and weight in by_node:
                found.add(by_node[weight])
    return [s.name for s in step.signature.state if s.name in found and s.kind == "param"]


def lookups_of(step: StepGraph, slot: str) -> list[fx.Node]:
    """The ``recir::*`` lookup nodes that read table ``slot``."""
    ph = state_placeholders(step)[slot]
    ops = lookup_ops()
    return [
        u
        for a in aliases_of(ph)
        for u in a.users
        if u.op == "call_function" and u.target in ops and u.args[0] is a
    ]


def optim_slots_of(step: StepGraph, param: str) -> list[StateSlot]:
    """Optimizer slots of ``param:<path>``: every ``optim:<path>:<key>`` slot."""
    path = slot_path(param)
    return [s for s in step.signature.state if s.kind == "optim" and slot_path(s.name) == path]


def require_grads(step: StepGraph, params: list[str], what: str) -> dict[str, fx.Node]:
    grads = grad_nodes(step)
    missing = [p for p in params if p not in grads]
    if missing:
        raise ConfigError(
            f"{what}: no node carries {GRAD_OF_KEY!r} for {missing[:4]}{'...' if len(missing) > 4 else ''}. "
            "Fix: capture the step with recir.capture.capture_train_step, which marks each parameter's "
            f"final gradient node, or set node.meta[{GRAD_OF_KEY!r}] = '<param slot>' by hand."
        )
    return grads
