"""phase_split: the forward-only or forward+backward part of a training StepGraph, as a StepGraph.

The base of training-to-inference: the result runs on the reference interpreter and verifies.
"""

from __future__ import annotations

from typing import Literal

import torch.fx as fx

from ._errors import ConfigError
from ._graph_util import alias_chain
from ._metadata import OPTIMIZER_KEY
from ._signature import OutputSlot, Signature
from ._step import PHASE_KEY, PHASES, StepGraph, format_node

PHASE_SPLIT_KEY = "recir.phase_split"


def phase_split(step: StepGraph, upto: Literal["forward", "backward"] = "forward") -> StepGraph:
    """A new StepGraph with only the nodes of phases up to ``upto`` (``step`` is not modified).

    What it returns, exactly:

    - state: the state slots that the kept nodes read, in their original order (for ``forward``
      typically the parameters and buffers; optimizer slots drop out). Each is returned unchanged as
      its new state (no state update happens: state written in the kept phases, e.g. running
      statistics, is dropped), so INV-3/INV-2 hold and ``init_state(model, optimizer)`` still works.
    - batch: every batch slot, unchanged (the user's batch pytree still flattens the same; unused
      leaves such as labels are simply not read).
    - outputs: the user outputs of ``step`` (the loss first) and, for ``upto="backward"``, then one
      output per value the dropped phases read from the kept ones, in graph order: named
      ``grad:<param slot>`` when the value feeds exactly one parameter's update (its gradient),
      ``value:<node>`` otherwise. Values that are only views of inputs are not outputs.
    - ``meta["recir.phase_split"] = upto``; the node names, ``val`` and ``recir.*`` metadata of kept
      nodes are those of ``step``.

    Raises ``ConfigError`` if a user output depends on a node of a dropped phase.
    """
    if upto not in ("forward", "backward"):
        raise ConfigError(f"phase_split: upto must be 'forward' or 'backward', got {upto!r}")
    keep = set(PHASES[: PHASES.index(upto) + 1])
    sig = step.signature
    n_state = len(sig.state)
    old_out = list(step.graph.output_node().args[0])
    user_outs = old_out[n_state:]

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.graph_copy(step.graph, env)
    old_nodes = list(step.graph.nodes)

    exits: list[tuple[str, fx.Node]] = []
    if upto == "backward":
        param_of = _param_reached(step)
        for node in old_nodes:
            if node.op != "call_function" or node.meta.get(PHASE_KEY) not in keep:
                continue
            readers = [u for u in node.users if u.op == "call_function" and u.meta.get(PHASE_KEY) not in keep]
            if not readers or alias_chain(node)[-1].op == "placeholder":
                continue
            params = param_of.get(node, set())
            name = f"grad:{sig.state[next(iter(params))].name}" if len(params) == 1 else f"value:{node.name}"
            exits.append((name, node))

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    results = [env[v] for v in user_outs] + [env[v] for _, v in exits]
    out_node = graph.output(tuple(results))  # state outputs are added once dead nodes are gone
    for node in reversed(list(graph.nodes)):  # dead code, random ops included (their phase is dropped)
        if node.op == "call_function" and not node.users:
            graph.erase_node(node)
    for node in graph.nodes:
        if node.op == "call_function" and node.meta.get(PHASE_KEY) not in keep:
            raise ConfigError(
                f"phase_split(upto={upto!r}): a user output needs %{node.name} of phase "
                f"{node.meta.get(PHASE_KEY)} ({format_node(node)}). Fix: compute user outputs (the loss, "
                "metrics) in the forward phase"
            )
    kept_state = [i for i in range(n_state) if placeholders[i].users]
    for i in range(n_state):
        if i not in kept_state:
            graph.erase_node(placeholders[i])
    out_node.args = (tuple([placeholders[i] for i in kept_state] + results),)

    outputs = list(sig.outputs) + [
        OutputSlot(name, tuple(node.meta["val"].shape), node.meta["val"].dtype) for name, node in exits
    ]
    signature = Signature(
        state=tuple(sig.state[i] for i in kept_state),
        batch=sig.batch,
        outputs=tuple(outputs),
        batch_spec=sig.batch_spec,
        output_spec=sig.output_spec if upto == "forward" else None,
    )
    gm = fx.GraphModule(step.graph_module, graph)
    # the optimizer phase and its slots are gone: so is the record of the optimizers (INV-9)
    meta = {k: v for k, v in step.meta.items() if k != OPTIMIZER_KEY}
    return step.replace(graph_module=gm, signature=signature, meta={**meta, PHASE_SPLIT_KEY: upto})


def _param_reached(step: StepGraph) -> dict[fx.Node, set[int]]:
    """For each node, the param-kind state slots whose new-state output depends on it."""
    sig = step.signature
    out = step.graph.output_node()
    direct: dict[fx.Node, set[int]] = {}
    for i, value in enumerate(out.args[0][: len(sig.state)]):
        if sig.state[i].kind == "param":
            direct.setdefault(value, set()).add(i)
    reached: dict[fx.Node, set[int]] = {}
    for node in reversed(list(step.graph.nodes)):
        acc = set(direct.get(node, ()))
        for user in node.users:
            acc |= reached.get(user, set())
        reached[node] = acc
    return reached
