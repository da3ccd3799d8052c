"""Reusing a traced optimizer update for every parameter that would trace the same nodes.

``make_fx`` costs about a millisecond per op (five dispatch modes per call); Adam traces 12-13 ops per
parameter, so a model with many same-shaped parameters (a stack of identical layers) spends most of its
optimizer phase tracing the same update again. The first parameter of each kind is traced; a later one
with the same update key (optimizer kind, group and hyper-parameters; shape, stride, dtype and device of
the parameter, its gradient and its state) gets a copy of those nodes, its own parameter, gradient and
state nodes in place of the first one's. The copy is made in the graph being traced, where the traced
update would have gone, so node order and every position mark stay what tracing would give; the step
returns the copies' values (:func:`finish_copies`, after ``make_fx``). A traced update that reads
anything but its parameter, gradient, state and the group's shared values (learning rate, step count,
bias corrections) is never copied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._functorch._aot_autograd.functional_utils import from_fun


@dataclasses.dataclass
class UpdateTemplate:
    """One traced update: its nodes, the nodes it reads that a copy replaces, and its result nodes."""

    nodes: list[fx.Node]
    inputs: list[fx.Node]  # parameter, gradient, state (in state_keys order)
    outputs: list[fx.Node]  # new parameter, new state (in state_keys order)


@dataclasses.dataclass
class UpdateCopies:
    """Templates by update key, and the step outputs the copies' values go to (output index -> node)."""

    templates: dict[Any, UpdateTemplate | None] = dataclasses.field(default_factory=dict)
    outputs: dict[int, fx.Node] = dataclasses.field(default_factory=dict)
    copied: list[fx.Node] = dataclasses.field(default_factory=list)


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    inner = from_fun(t)
    shape, stride = tuple(inner.shape), tuple(inner.stride())
    if not all(type(s) is int for s in (*shape, *stride)):
        return None  # symbolic sizes: always trace
    return (shape, stride, inner.dtype, inner.device, inner.layout)


def update_key(spec: Any, tensors: Sequence[torch.Tensor]) -> tuple[Any, ...] | None:
    """What decides the traced update's nodes, or None when it must be traced (symbolic sizes)."""
    keys = [_tensor_key(t) for t in tensors]
    if any(k is None for k in keys):
        return None
    return (spec.kind, spec.group, repr(sorted(spec.hparams.items())), spec.state_keys, *keys)


def record_template(
    graph: fx.Graph,
    start: int,
    inputs: Sequence[fx.Node | None],
    outputs: Sequence[fx.Node | None],
    shared: Sequence[fx.Node | None],
) -> UpdateTemplate | None:
    """The update traced since node count ``start``, or None where a copy could not be exact: it reads
    a node that is neither one of ``inputs`` nor ``shared`` (the group's values), or a result is not
    one of its nodes or inputs."""
    nodes = list(graph.nodes)[start:]
    if None in inputs or None in outputs:
        return None
    members = set(nodes)
    allowed = set(inputs) | {n for n in shared if n is not None}
    for node in nodes:
        if node.op != "call_function":
            return None  # a placeholder, get_attr or output traced inside an update: trace each one
        for arg in node.all_input_nodes:
            if arg not in members and arg not in allowed:
                return None
    for out in outputs:
        if out not in members and out not in inputs:
            return None
    return UpdateTemplate(nodes, list(inputs), list(outputs))  # type: ignore[arg-type]


def copy_template(
    graph: fx.Graph, template: UpdateTemplate, inputs: Sequence[fx.Node | None], copies: UpdateCopies
) -> list[fx.Node] | None:
    """Append a copy of ``template`` reading ``inputs``; its result nodes (None: an input is untraced)."""
    if None in inputs:
        return None
    env: dict[fx.Node, fx.Node] = dict(zip(template.inputs, inputs))  # type: ignore[arg-type]
    for node in template.nodes:
        env[node] = graph.node_copy(node, lambda a: env.get(a, a))
        copies.copied.append(env[node])
    return [env[o] for o in template.outputs]


def finish_copies(gm: fx.GraphModule, copies: UpdateCopies, fake_mode: Any) -> None:
    """Point the step's outputs at the copies' results and give each copy a value of its own."""
    if not copies.outputs:
        return
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = list(output.args[0])
    for i, node in copies.outputs.items():
        outs[i] = node
    output.args = (type(output.args[0])(outs),)
    with fake_mode:
        for node in copies.copied:
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                node.meta["val"] = torch.empty_strided(
                    val.shape, val.stride(), dtype=val.dtype, device=val.device
                )
