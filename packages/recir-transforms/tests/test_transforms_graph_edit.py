"""The one home of each graph edit other packages share: StepGraph.copy, splice, format_window."""

from __future__ import annotations

import pytest
import torch
from _transforms_stepgraphs import mlp_sgd_step
from recir.transforms import (
    PHASE_KEY,
    PROVENANCE_KEY,
    ConfigError,
    copy_graph_module,
    format_node,
    format_val,
    format_window,
    splice,
    verify,
)


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


def test_format_window_marks_the_node_with_the_callers_mark():
    step, _, _ = mlp_sgd_step()
    relu = next(n for n in step.graph.nodes if n.target is torch.ops.aten.relu.default)
    text = format_window(step.graph, relu, radius=1, mark="--> ")
    lines = text.splitlines()
    assert lines[0].startswith(f"graph around %{relu.name} (nodes ")
    marked = [line for line in lines if "-->" in line]
    assert marked == [f"  --> {format_node(relu, vals=True)}"]
    assert sum(line.startswith("      %") for line in lines) == 2  # one neighbour each side, aligned
    assert f">>> %{relu.name}" in format_window(step.graph, relu)


def test_splice_traces_fn_on_the_args_vals_and_inserts_it_before_a_node():
    step, state, batch = mlp_sgd_step()
    graph = step.graph
    relu = next(n for n in graph.nodes if n.target is torch.ops.aten.relu.default)
    (x,) = relu.args
    (out,) = splice(
        graph, lambda v: (torch.clamp_min(v, 0.0),), [x], before=relu, phase="forward", provenance="t"
    )
    assert out.target is torch.ops.aten.clamp_min.default and out.args[0] is x and out.next is relu
    assert out.meta[PHASE_KEY] == "forward" and out.meta[PROVENANCE_KEY] == ["t"]
    assert format_val(out.meta["val"]) == format_val(relu.meta["val"])
    relu.replace_all_uses_with(out)
    graph.erase_node(relu)
    step.graph_module.recompile()
    verify(step)
    with pytest.raises(ConfigError, match="splice: argument %"):
        splice(graph, lambda v: v, [_no_val(graph)], before=out, phase="forward")


def _no_val(graph):
    node = next(n for n in graph.nodes if n.op == "call_function")
    twin = graph.call_function(torch.ops.aten.relu.default, (node,))
    twin.meta.pop("val", None)
    return twin
