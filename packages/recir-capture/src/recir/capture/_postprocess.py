"""Turn the raw make_fx graph into a StepGraph body: tags, cleanup, and the checks that need the whole graph.

Phases come from node-count marks recorded while tracing; ``detach`` nodes are dropped; random,
mutating and constant-tensor nodes are reported as :class:`CaptureError` with the fix.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torch.fx as fx
from recir.transforms import (
    DROPOUT_KEY,
    OPTIM_PARAM_KEY,
    OVERRIDE_KEY,
    PHASE_KEY,
    RNG_MASK_KEY,
    SCOPE_KEY,
    CaptureError,
    override_for_op,
    parse_slot_name,
    slot_path,
)

_DROP = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.lift_fresh.default}


def tag_phases(graph: fx.Graph, marks: dict[str, int], param_ranges: Sequence[tuple[str, int, int]]) -> None:
    """``marks``: node counts when backward and optimizer began; ``param_ranges``: (slot, start, end)."""
    nodes = list(graph.nodes)
    for i, node in enumerate(nodes):
        if node.op in ("placeholder", "output"):
            continue
        if i < marks["backward"]:
            node.meta[PHASE_KEY] = "forward"
        elif i < marks["optimizer"]:
            node.meta[PHASE_KEY] = "backward"
        else:
            node.meta[PHASE_KEY] = "optimizer"
    for slot, start, end in param_ranges:
        for node in nodes[start:end]:
            if node.op not in ("placeholder", "output"):
                node.meta[OPTIM_PARAM_KEY] = slot


def _module_of(slot: str) -> str:
    """``param:layers.0.uvqk.weight`` -> ``layers.0.uvqk`` (the module that owns the tensor)."""
    return str(slot_path(slot)).rpartition(".")[0]


def tag_rng_masks(
    graph: fx.Graph, marks: Sequence[int], dropout_marks: Sequence[tuple[int, float]] = ()
) -> None:
    """``recir.rng_mask`` on each dropout's boolean keep mask and ``recir.dropout`` (its p) on each
    dropout's output ``input * scaled_mask`` (``marks``: node positions at tracing)."""
    nodes = list(graph.nodes)
    for i, p in dropout_marks:
        if 0 <= i < len(nodes) and nodes[i].target is torch.ops.aten.mul.Tensor:
            nodes[i].meta[DROPOUT_KEY] = p
    for i in marks:
        if not 0 <= i < len(nodes):
            continue
        val = nodes[i].meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype == torch.bool:  # else the position moved: no tag
            nodes[i].meta[RNG_MASK_KEY] = "dropout"


def tag_scopes(
    graph: fx.Graph,
    marks: Sequence[tuple[int, str]],
    backward_start: int,
    state_names: Sequence[str],
    grad_nodes: dict[fx.Node, str],
) -> None:
    """``recir.scope`` on every compute node. Forward: the module that was running when the node was
    traced (``marks``: node counts at module entries/exits). Backward: the module of the nearest
    parameter gradient it feeds (``grad_nodes``: gradient node -> parameter slot). Optimizer: its
    parameter's module."""
    nodes = list(graph.nodes)
    scopes: dict[fx.Node, str] = {}
    j, current = 0, ""
    for i, node in enumerate(nodes[:backward_start]):
        while j < len(marks) and marks[j][0] <= i:
            current = marks[j][1]
            j += 1
        if node.op not in ("placeholder", "output"):
            scopes[node] = current
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for node, slot in zip(placeholders, state_names):  # the state slots come first
        if parse_slot_name(slot).kind in ("param", "buffer"):
            scopes[node] = _module_of(slot)
    # optimizer: the parameter's module
    for node in nodes[backward_start:]:
        param = node.meta.get(OPTIM_PARAM_KEY)
        if param is not None and node.op == "call_function":
            scopes[node] = _module_of(str(param))
    # backward: the module of the nearest parameter gradient the node feeds (users first, so walk back)
    nearest: dict[fx.Node, tuple[int, str]] = {}
    for node, slot in grad_nodes.items():
        nearest[node] = (0, _module_of(slot))
    backward = [n for n in nodes[backward_start:] if n.op == "call_function" and n not in scopes]
    for node in reversed(backward):
        if node in nearest:
            continue
        reach = [nearest[u] for u in node.users if u in nearest]
        if reach:
            d, scope = min(reach, key=lambda r: r[0])
            nearest[node] = (d + 1, scope)
    for node in backward:
        if node in nearest:
            scopes[node] = nearest[node][1]
        else:  # feeds no gradient (e.g. a metric): the forward values it reads
            inputs = [scopes[a] for a in node.all_input_nodes if a in scopes]
            scopes[node] = max(inputs, key=len) if inputs else ""
    for node, scope in scopes.items():
        if node.op == "call_function":
            node.meta[SCOPE_KEY] = scope


def drop_identity_nodes(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _DROP:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def tag_overrides(graph: fx.Graph) -> list[str]:
    names = []
    for node in graph.nodes:
        target = node.target
        if (
            node.op == "call_function"
            and isinstance(target, torch._ops.OpOverload)
            and target.namespace == "recir"
        ):
            owner = override_for_op(target)
            if owner is not None:
                node.meta[OVERRIDE_KEY] = owner
                names.append(owner)
    return names


def check_graph(graph: fx.Graph, gm: fx.GraphModule) -> None:
    for node in graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, str(node.target), None)
            if isinstance(value, torch.Tensor):
                raise CaptureError(
                    f"the step uses a constant tensor {_describe_const(value)} that is neither a parameter, "
                    "a buffer nor a batch input (a plain tensor attribute of a module, or torch.tensor(...) "
                    "built in forward).\nFix: register it with `module.register_buffer(name, tensor)` "
                    "(persistent=False if it is not to be saved), or build it from a Python scalar with "
                    "torch.full(...)."
                )
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        op = node.target
        if torch.Tag.nondeterministic_seeded in op.tags:
            raise CaptureError(
                f"random op {op} is not supported by capture (its randomness would not be carried in the "
                "step's rng state).\nFix: use torch.nn.Dropout / F.dropout, torch.rand/randn(_like) or "
                "torch.bernoulli, which capture routes to the state-carried RNG; for "
                "scaled_dot_product_attention pass dropout_p=0 and apply F.dropout yourself."
            )
        if op._schema.is_mutable:
            raise CaptureError(
                f"internal: functionalization left the mutating op {op} in the graph (node {node.name}).\n"
                "Fix: report this with the model; meanwhile rewrite the in-place op out-of-place."
            )


def _describe_const(value: torch.Tensor) -> str:
    return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"


def inline_scalar_constants(gm: fx.GraphModule) -> None:
    """Replace get_attr of 1-element tensor constants (``torch.tensor(2.0)`` in forward) by ``aten.full``."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(gm, str(node.target), None)
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.is_sparse:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(
                torch.ops.aten.full.default,
                (list(value.shape), value.item()),
                {"dtype": value.dtype, "device": value.device},
            )
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        delattr(gm, str(node.target))


def unalias_user_outputs(graph: fx.Graph, num_state: int) -> None:
    """Clone user outputs that are (views of) inputs or also new state, so no output aliases state (INV-2)."""
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])
    state_nodes = set(outs[:num_state])
    for i in range(num_state, len(outs)):
        node = outs[i]
        if not isinstance(node, fx.Node):
            continue
        base = node
        while (
            base.op == "call_function"
            and isinstance(base.target, torch._ops.OpOverload)
            and base.target.is_view
            and isinstance(base.args[0], fx.Node)
        ):
            base = base.args[0]
        if base.op == "placeholder" or node in state_nodes:
            with graph.inserting_before(output):
                clone = graph.call_function(torch.ops.aten.clone.default, (node,))
            clone.meta = {k: v for k, v in node.meta.items() if k in ("val", PHASE_KEY)}
            clone.meta.setdefault(PHASE_KEY, "forward")
            outs[i] = clone
    output.args = (outs,)


def rename_placeholders(graph: fx.Graph, names: Sequence[str]) -> None:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names):
        ident = re.sub(r"\W+", "_", name).strip("_") or "arg"
        node.target = ident
        node._rename(ident)
