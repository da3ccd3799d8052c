"""region_times / format_region_table: per-node seconds grouped by recir.scope and phase."""

from __future__ import annotations

from _transforms_stepgraphs import mlp_sgd_step
from recir.transforms import SCOPE_KEY, format_region_table, region_times


def test_region_times_group_by_scope_and_phase():
    step, _, _ = mlp_sgd_step()
    compute = [n for n in step.graph.nodes if n.op == "call_function"]
    for i, node in enumerate(compute):
        node.meta[SCOPE_KEY] = "layers.0.mlp.fc1" if i % 2 else "layers.1"
    seconds = {n.name: 0.001 for n in compute} | {"copy.7": 0.5}  # an event the graph has no node for
    rows = region_times(step, seconds, depth=2)
    assert rows[0].scope == "(outside the graph)" and rows[0].seconds == 0.5
    by_key = {(r.scope, r.phase): r for r in rows}
    forward = [n for n in compute if n.meta["recir.phase"] == "forward"]
    expected = sum(1 for i, n in enumerate(compute) if i % 2 and n.meta["recir.phase"] == "forward")
    assert by_key[("layers.0", "forward")].nodes == expected  # cut to depth 2
    assert sum(r.nodes for r in rows if r.phase == "forward") == len(forward)
    assert abs(sum(r.seconds for r in rows) - (0.5 + 0.001 * len(compute))) < 1e-9
    table = format_region_table(rows, steps=2, limit=2)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["region", "phase", "ms/step"]
    assert "(outside the graph)" in lines[1] and " 250.00 " in lines[1]  # 0.5 s over 2 steps
    assert "more regions" in lines[-2] and lines[-1].startswith("total")


def test_region_times_without_scopes_use_the_top_level():
    step, _, _ = mlp_sgd_step()
    rows = region_times(step, {n.name: 0.01 for n in step.graph.nodes if n.op == "call_function"})
    assert {r.scope for r in rows} == {"(top level)"}
    assert {r.phase for r in rows} == {"forward", "backward", "optimizer"}
