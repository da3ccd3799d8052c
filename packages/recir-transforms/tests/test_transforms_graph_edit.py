"""The one home of each graph edit other packages share: StepGraph.copy, splice, format_window."""

from __future__ import annotations

import torch
from _transforms_stepgraphs import mlp_sgd_step
from recir.transforms import PHASE_KEY, copy_graph_module


def test_step_copy_owns_its_graph_and_node_metadata():
    step, state, batch = mlp_sgd_step()
    before = step.format_graph(vals=True)
    twin = step.copy()
    assert twin.graph is not step.graph and twin.signature is step.signature
    assert twin.format_graph(vals=True) == before
    relu = next(n for n in twin.graph.nodes if n.target is torch.ops.aten.relu.default)
    relu.meta[PHASE_KEY] = "backward"  # metadata dicts are per copy: the original keeps its phase
    relu.target = torch.ops.aten.sigmoid.default
    twin.graph_module.recompile()
    assert step.format_graph(vals=True) == before
    gm = copy_graph_module(step.graph_module)
    assert gm.graph is not step.graph and str(gm.graph) == str(step.graph)
