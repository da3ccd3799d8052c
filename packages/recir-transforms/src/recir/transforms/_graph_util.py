"""Graph helpers shared by the verifier and the transforms: alias analysis through view ops, and
readable formatting of values and graph windows.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ._step import _fmt_val, format_node

# Views that return their input unchanged: a frozen slot may be returned through them.
_IDENTITY_VIEWS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def node_val(node: Any) -> Any:
    """A node's ``meta["val"]`` (its example value), or None for a non-node argument or a node without one."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def format_val(val: Any) -> str:
    """``float32[4, 8]`` for a tensor, a tuple of those for multi-output nodes, ``repr`` otherwise."""
    return "None" if val is None else _fmt_val(val)


def format_window(graph: fx.Graph, node: fx.Node | None, radius: int = 6, *, mark: str = ">>> ") -> str:
    """The graph's lines around ``node`` (marked ``mark``), with elision marks; the head if node is None.

    The one graph-window printer of every error that points into a graph (verifier, lowerings).
    """
    nodes = list(graph.nodes)
    idx = nodes.index(node) if node is not None and node in nodes else 0
    lo, hi = max(0, idx - radius), min(len(nodes), idx + radius + 1)
    lines = [
        f"graph around {'%' + node.name if node is not None else 'the start'} "
        f"(nodes {lo}-{hi - 1} of {len(nodes)}):"
    ]
    if lo > 0:
        lines.append("      ...")
    for i in range(lo, hi):
        prefix = mark if node is not None and nodes[i] is node else " " * len(mark)
        lines.append(f"  {prefix}{format_node(nodes[i], vals=True)}")
    if hi < len(nodes):
        lines.append("      ...")
    return "\n".join(lines)


def alias_chain(node: fx.Node) -> list[fx.Node]:
    """``node``, then each tensor it is a view of, back to the base that owns the memory."""
    chain = [node]
    while node.op == "call_function":
        src: fx.Node | None = None
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            parent = node.args[0]
            if isinstance(parent.target, torch._ops.OpOverload) and _view_source(parent) is not None:
                src = _view_source(parent)
        elif isinstance(node.target, torch._ops.OpOverload):
            src = _view_source(node)
        if src is None:
            break
        chain.append(src)
        node = src
    return chain


def _alias_base(node: fx.Node) -> tuple[fx.Node, bool]:
    """Follow view ops back to the tensor ``node`` aliases; also whether every view was an identity view."""
    identity = True
    while node.op == "call_function":
        target = node.target
        if target is operator.getitem and isinstance(node.args[0], fx.Node):
            parent = node.args[0]
            if isinstance(parent.target, torch._ops.OpOverload) and _view_source(parent) is not None:
                node, identity = parent, False
                continue
            return node, identity
        if not isinstance(target, torch._ops.OpOverload):
            return node, identity
        src = _view_source(node)
        if src is None:
            return node, identity
        identity = identity and target in _IDENTITY_VIEWS
        node = src
    return node, identity


def _view_source(node: fx.Node) -> fx.Node | None:
    """The argument a view op's result aliases (alias annotation without write), else None."""
    schema = node.target._schema  # type: ignore[union-attr]
    ret_sets: set[str] = set()
    for ret in schema.returns:
        if ret.alias_info is not None and not ret.alias_info.is_write:
            ret_sets |= set(ret.alias_info.before_set)
    if not ret_sets:
        return None
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not (set(info.before_set) & ret_sets):
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, fx.Node):
            return value
    return None


_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def call_like(
    graph: fx.Graph, like: fx.Node, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> fx.Node:
    """A new node ``target(*args, **kwargs)`` at the insertion point, with ``like``'s metadata (phase,
    provenance, ...) and its value computed on the inputs' fake values. A view of a value that is no
    longer contiguous (a slice) becomes a reshape."""
    kwargs = kwargs or {}
    try:
        val = _fake_run(target, args, kwargs)
    except (RuntimeError, ValueError):  # fake tensors raise either for a view of a non-contiguous value
        if target not in _RESHAPES:
            raise
        target = torch.ops.aten.reshape.default
        val = _fake_run(target, args, kwargs)
    new = graph.call_function(target, args, kwargs)
    new.meta = {**{k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta")}, "val": val}
    return new


def _fake_run(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    def unwrap(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return node_val(a)
        if isinstance(a, (list, tuple)):
            return type(a)(unwrap(x) for x in a)
        return a

    return target(*unwrap(args), **{k: unwrap(v) for k, v in kwargs.items()})
