"""Time per StepGraph region: a profiler's per-node seconds grouped by module scope and phase.

A lowering maps its profiler's events to graph node names (the TPU path's HLO carries them as JAX
name scopes); this module turns ``{node name: seconds}`` into the table a person reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ._step import OVERRIDE_KEY, PHASE_KEY, SCOPE_KEY, StepGraph


@dataclasses.dataclass(frozen=True)
class RegionTime:
    """Seconds spent in one region: a module scope (cut to ``depth`` parts) in one phase."""

    scope: str
    phase: str
    seconds: float
    nodes: int


def _region_of(scope: str, depth: int) -> str:
    parts = [p for p in scope.split(".") if p]
    return ".".join(parts[:depth]) if parts else "(top level)"


def region_times(step: StepGraph, node_seconds: Mapping[str, float], depth: int = 3) -> list[RegionTime]:
    """Group ``node_seconds`` (graph node name -> seconds) by (scope cut to ``depth``, phase), largest
    first. Override ops (embedding lookups, table updates) are regions of their own; seconds of names
    the graph does not have go to the ``(outside the graph)`` region."""
    nodes = {n.name: n for n in step.graph.nodes}
    acc: dict[tuple[str, str], list[float]] = {}
    for name, seconds in node_seconds.items():
        node = nodes.get(name)
        if node is None:
            key = ("(outside the graph)", "-")
        else:
            override = node.meta.get(OVERRIDE_KEY)
            scope = f"[{override}]" if override else _region_of(str(node.meta.get(SCOPE_KEY, "")), depth)
            key = (scope, str(node.meta.get(PHASE_KEY, "-")))
        entry = acc.setdefault(key, [0.0, 0])
        entry[0] += seconds
        entry[1] += 1
    rows = [RegionTime(scope, phase, s, int(n)) for (scope, phase), (s, n) in acc.items()]
    return sorted(rows, key=lambda r: -r.seconds)


def format_region_table(rows: list[RegionTime], steps: int = 1, limit: int = 30) -> str:
    """A plain-text table: ms per step and share of the total, per region (the ``limit`` largest)."""
    total = sum(r.seconds for r in rows) or 1.0
    w = max([9, *(len(r.phase) for r in rows[:limit])])  # "backward+optimizer" for a lowering's glue
    lines = [f"{'region':<40} {'phase':<{w}} {'ms/step':>9} {'share':>6} {'nodes':>6}"]
    for r in rows[:limit]:
        lines.append(
            f"{r.scope[:40]:<40} {r.phase:<{w}} {r.seconds * 1000 / steps:>9.2f} "
            f"{100 * r.seconds / total:>5.1f}% {r.nodes:>6}"
        )
    if len(rows) > limit:
        rest = sum(r.seconds for r in rows[limit:])
        lines.append(
            f"{'(' + str(len(rows) - limit) + ' more regions)':<40} {'':<{w}} {rest * 1000 / steps:>9.2f}"
        )
    lines.append(f"{'total':<40} {'':<{w}} {total * 1000 / steps:>9.2f}")
    return "\n".join(lines)
