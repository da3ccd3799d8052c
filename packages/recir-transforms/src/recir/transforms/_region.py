"""Region: a coherent (convex) subgraph of a StepGraph with its entry and exit values, replaceable by
tracing a function into the graph; RegionTransform = match(step) -> [Region] + rewrite(step, region).
"""

from __future__ import annotations

import abc
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from ._errors import ConfigError
from ._graph_util import format_val, format_window
from ._override import override_for_op
from ._step import OVERRIDE_KEY, PHASE_KEY, PHASES, PROVENANCE_KEY, REGION_KEY, StepGraph
from ._transform import Transform, TransformResult


class Region:
    """A convex set of compute nodes of ``step``, in graph order.

    ``inputs`` are the values entering it (nodes outside read by nodes inside, in order of first use) and
    ``outputs`` the values leaving it (nodes inside read outside, in graph order). Convex means no path
    leaves the region and comes back, so the region can be replaced by one computation.
    """

    def __init__(self, step: StepGraph, nodes: Iterable[fx.Node], name: str = "") -> None:
        members = set(nodes)
        order = {n: i for i, n in enumerate(step.graph.nodes)}
        for n in members:
            if n not in order or n.op != "call_function":
                raise ConfigError(f"region {name!r}: %{n.name} is not a compute node of this graph")
        if not members:
            raise ConfigError(f"region {name!r} is empty")
        self.step = step
        self.name = name
        self.nodes: list[fx.Node] = sorted(members, key=order.__getitem__)
        # entries in order of first use (node order, then argument order): for a one-node region
        # they are the node's own arguments, which is what a replacement function expects
        entries = {a: None for n in self.nodes for a in n.all_input_nodes if a not in members}
        self.inputs: list[fx.Node] = list(entries)
        self.outputs: list[fx.Node] = [n for n in self.nodes if any(u not in members for u in n.users)]
        self._check_convex(members, order)
        self._replaced = False

    def _check_convex(self, members: set[fx.Node], order: dict[fx.Node, int]) -> None:
        last = order[self.nodes[-1]]
        frontier = [u for n in self.outputs for u in n.users if u not in members and order[u] < last]
        seen: set[fx.Node] = set()
        while frontier:
            node = frontier.pop()
            if node in seen:
                continue
            seen.add(node)
            for user in node.users:
                if user in members:
                    raise ConfigError(
                        f"region {self.name!r} is not convex: %{node.name} (outside) reads the region and "
                        f"feeds %{user.name} (inside). Fix: include %{node.name} in the region or split it.\n"
                        + format_window(self.step.graph, node)
                    )
                if order[user] < last:
                    frontier.append(user)

    @property
    def phases(self) -> list[str]:
        """The phases of the region's nodes, in phase order."""
        present = {n.meta.get(PHASE_KEY) for n in self.nodes}
        return [p for p in PHASES if p in present]

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        ins = ", ".join(f"%{n.name}" for n in self.inputs)
        outs = ", ".join(f"%{n.name}" for n in self.outputs)
        return f"Region({self.name or '?'}: {len(self.nodes)} nodes, ({ins}) -> ({outs}), {'/'.join(self.phases)})"

    def format(self) -> str:
        """The region as a small graph: its entries, nodes and exits."""
        from ._step import format_node

        lines = [repr(self)] + [f"  {format_node(n)}" for n in self.nodes]
        return "\n".join(lines)

    # -- replacement --------------------------------------------------------------------------------
    def replace(
        self,
        fn: Callable[..., Any],
        *,
        phase: str | None = None,
        provenance: str | None = None,
        decompositions: dict[Any, Callable[..., Any]] | None = None,
        extra_inputs: Sequence[fx.Node] = (),
    ) -> Region:
        """Replace the region by ``fn(*entry tensors) -> exit tensor(s)``, traced with make_fx on the entry ``val``s.

        ``fn`` receives one FakeTensor per ``inputs`` entry, then one per ``extra_inputs`` node (values
        outside the region that the replacement reads and the old nodes did not, e.g. a new state slot's
        placeholder), and returns a tensor or a sequence of ``len(outputs)`` tensors with the exits'
        shapes and dtypes. The traced nodes are spliced in with
        their ``val``, the region's phase (or ``phase``), its ``recir.region`` ids plus ``name``,
        ``recir.override`` for recir::* ops, and ``provenance`` appended to ``recir.provenance``.
        Returns the Region of the new nodes; this one becomes unusable.
        """
        if self._replaced:
            raise ConfigError(f"region {self.name!r} was already replaced")
        graph = self.step.graph
        phase = phase or self._single_phase()
        members = set(self.nodes)
        inside = [n.name for n in extra_inputs if n in members]
        if inside:
            raise ConfigError(
                f"region {self.name!r}: extra input %{inside[0]} is a node of the region; extra inputs are "
                "values from outside it"
            )
        entries = [*self.inputs, *extra_inputs]
        vals = []
        for entry in entries:
            val = entry.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise ConfigError(
                    f"region {self.name!r}: entry %{entry.name} has val {format_val(val)}, not a tensor; "
                    "include its producer (or the getitem) in the region"
                )
            vals.append(val)
        sub = _trace(fn, vals, decompositions)
        sub_out = list(sub.graph.output_node().args[0])
        self._check_outputs(sub_out)

        common = self._common_region_ids()
        region_ids = [*common, *([self.name] if self.name and self.name not in common else [])]
        new_outputs, created = _insert(
            graph,
            sub,
            entries,
            before=self._insertion_point(extra_inputs),
            phase=phase,
            provenance=provenance,
            region_ids=region_ids,
            what=f"region {self.name!r}",
        )
        for old, new_value in zip(self.outputs, new_outputs):
            old.replace_all_uses_with(new_value, delete_user_cb=lambda u: u not in members)
        for node in reversed(self.nodes):
            graph.erase_node(node)
        self._replaced = True
        self.step.graph_module.recompile()
        if not created:  # fn returned its inputs: nothing new in the graph
            return self
        return Region(self.step, created, self.name)

    def _single_phase(self) -> str:
        phases = self.phases
        if len(phases) != 1:
            raise ConfigError(
                f"region {self.name!r} spans phases {phases}; pass replace(..., phase=) to say which the new nodes get"
            )
        return phases[0]

    def _common_region_ids(self) -> list[str]:
        ids = [list(n.meta.get(REGION_KEY) or ()) for n in self.nodes]
        return [i for i in ids[0] if all(i in other for other in ids[1:])]

    def _check_outputs(self, sub_out: Sequence[Any]) -> None:
        if len(sub_out) != len(self.outputs):
            raise ConfigError(
                f"region {self.name!r}: the replacement returns {len(sub_out)} values, the region has "
                f"{len(self.outputs)} exits ({', '.join('%' + n.name for n in self.outputs)})"
            )
        for old, new in zip(self.outputs, sub_out):
            if not isinstance(new, fx.Node):
                raise ConfigError(
                    f"region {self.name!r}: the replacement returned a constant for %{old.name}"
                )
            a, b = old.meta.get("val"), new.meta.get("val")
            if format_val(a) != format_val(b):
                raise ConfigError(
                    f"region {self.name!r}: exit %{old.name} is {format_val(a)}, the replacement gives "
                    f"{format_val(b)}. Fix: return the same shapes and dtypes (or cast)"
                )

    def _insertion_point(self, extra_inputs: Sequence[fx.Node] = ()) -> fx.Node:
        """The node before which the replacement goes: after every entry, before every outside user."""
        graph = self.step.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        members = set(self.nodes)
        last_entry = max((order[n] for n in [*self.inputs, *extra_inputs]), default=-1)
        first_region = order[self.nodes[0]]
        nodes = list(graph.nodes)
        at = max(first_region, last_entry + 1)
        first_user = min(
            (order[u] for n in self.outputs for u in n.users if u not in members), default=len(nodes)
        )
        if at > first_user:
            raise ConfigError(
                f"region {self.name!r}: no place for the replacement (entry %{nodes[last_entry].name} is defined "
                f"after %{nodes[first_user].name} reads an exit). Fix: choose a region whose entries precede its users"
            )
        return nodes[at]


def splice(
    graph: fx.Graph,
    fn: Callable[..., Any],
    args: Sequence[fx.Node],
    *,
    before: fx.Node,
    phase: str,
    provenance: str | None = None,
    decompositions: dict[Any, Callable[..., Any]] | None = None,
) -> list[fx.Node]:
    """Trace ``fn`` on the FakeTensor ``val`` of ``args`` and insert its nodes before ``before``.

    The one way to splice a traced subgraph into a graph (``Region.replace`` is built on it); for a
    rewrite whose old nodes form a region, prefer ``Region.replace``, which also rewires their users.
    Returns the nodes of ``fn``'s flat outputs (a tensor or a tuple/list of tensors). New nodes get
    ``val``, ``recir.phase`` = ``phase``, ``recir.override`` for override ops, and ``provenance``.
    """
    vals = []
    for arg in args:
        val = arg.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ConfigError(f"splice: argument %{arg.name} has val {format_val(val)}, not a tensor")
        vals.append(val)
    sub = _trace(fn, vals, decompositions)
    outputs, _ = _insert(
        graph, sub, args, before=before, phase=phase, provenance=provenance, region_ids=(), what="splice"
    )
    return outputs


def _insert(
    graph: fx.Graph,
    sub: fx.GraphModule,
    args: Sequence[fx.Node],
    *,
    before: fx.Node,
    phase: str,
    provenance: str | None,
    region_ids: Sequence[str],
    what: str,
) -> tuple[list[fx.Node], list[fx.Node]]:
    """Copy ``sub``'s compute nodes into ``graph`` before ``before``, its placeholders bound to ``args``.

    Returns the nodes of ``sub``'s outputs and the nodes created. Metadata is fresh: ``val``, the
    phase, ``region_ids`` (if any), ``recir.override`` for override ops and ``provenance``.
    """
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, args))
    created: list[fx.Node] = []
    with graph.inserting_before(before):
        for node in sub.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op != "call_function":
                raise ConfigError(
                    f"{what}: the replacement produced a {node.op} node ({node.target}); "
                    "build constants with torch.full/arange (tensor constants are hidden state, INV-1)"
                )
            new = graph.node_copy(node, lambda n: env[n])
            new.meta = {"val": node.meta.get("val"), PHASE_KEY: phase}
            if region_ids:
                new.meta[REGION_KEY] = list(region_ids)
            owner = override_for_op(new.target)
            if owner is not None:
                new.meta[OVERRIDE_KEY] = owner
            if provenance:
                new.meta[PROVENANCE_KEY] = [provenance]
            env[node] = new
            created.append(new)
    return [env[v] for v in sub.graph.output_node().args[0]], created


def _trace(
    fn: Callable[..., Any], vals: list[torch.Tensor], decompositions: dict[Any, Any] | None
) -> fx.GraphModule:
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = detect_fake_mode(vals)
    if fake_mode is None:  # real example values: trace them fake anyway
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        vals = [fake_mode.from_tensor(v) for v in vals]

    def flat(*args: torch.Tensor) -> tuple[Any, ...]:
        out = fn(*args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    with fake_mode:
        # fresh tensors per entry: make_fx tracks tensors by identity, so one val object shared by two
        # entries (node_copy shares meta) would silently bind both to one placeholder
        args = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in vals]
        return make_fx(flat, decomposition_table=decompositions or {})(*args)


# -- finding regions ---------------------------------------------------------------------------------
def regions_by_phase(step: StepGraph, phase: str) -> list[Region]:
    """All compute nodes of one phase, as one region (phases flow forward, so it is convex); [] if none."""
    if phase not in PHASES:
        raise ConfigError(f"unknown phase {phase!r}; phases are {PHASES}")
    nodes = [n for n in step.graph.nodes if n.op == "call_function" and n.meta.get(PHASE_KEY) == phase]
    return [Region(step, nodes, phase)] if nodes else []


def regions_by_override(step: StepGraph, override: str | None = None) -> list[Region]:
    """One region per node carrying ``recir.override`` (equal to ``override`` if given), with its getitems."""
    out = []
    for node in step.graph.nodes:
        name = node.meta.get(OVERRIDE_KEY)
        if node.op != "call_function" or name is None or (override is not None and name != override):
            continue
        getitems = [u for u in node.users if u.target is operator.getitem]
        out.append(Region(step, [node, *getitems], f"{name}:{node.name}"))
    return out


def regions_by_id(step: StepGraph, region_id: str) -> list[Region]:
    """The nodes whose ``recir.region`` ids contain ``region_id``, as one region; [] if none."""
    nodes = [
        n for n in step.graph.nodes if n.op == "call_function" and region_id in (n.meta.get(REGION_KEY) or ())
    ]
    return [Region(step, nodes, region_id)] if nodes else []


def regions_by_pattern(
    step: StepGraph,
    pattern: Callable[..., Any],
    example_inputs: Sequence[torch.Tensor],
    *,
    name: str = "pattern",
    phase: str | None = None,
    ignore_literals: bool = False,
) -> list[Region]:
    """Non-overlapping matches of ``pattern`` (a function traced with make_fx on ``example_inputs``).

    Shapes are not compared (only ops, structure and, unless ``ignore_literals``, literal arguments);
    ``phase`` keeps only matches inside that phase. Each match is a region named ``<name>:<i>``.
    """
    from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

    # distinct tensors: make_fx would turn one tensor passed twice into one shared placeholder
    pat = make_fx(pattern, tracing_mode="fake")(*[t.clone() for t in example_inputs])
    matcher = SubgraphMatcher(
        pat.graph, match_output=False, match_placeholder=False, ignore_literals=ignore_literals
    )
    regions: list[Region] = []
    for m in matcher.match(step.graph):
        nodes = [v for k, v in m.nodes_map.items() if k.op == "call_function"]
        if phase is not None and any(n.meta.get(PHASE_KEY) != phase for n in nodes):
            continue
        try:
            regions.append(Region(step, nodes, f"{name}:{len(regions)}"))
        except ConfigError:  # a non-convex match cannot be replaced as one piece
            continue
    return regions


class RegionTransform(Transform):
    """A transform that finds regions (``match``) and rewrites each (``rewrite``, usually ``region.replace``).

    ``rewrite`` returns False to skip a region. ``stats``: ``matched`` and ``rewritten`` counts.
    """

    @abc.abstractmethod
    def match(self, step: StepGraph) -> list[Region]:
        """The regions to rewrite, found before any rewrite happens."""

    @abc.abstractmethod
    def rewrite(self, step: StepGraph, region: Region) -> bool | None:
        """Rewrite one region in place (``region.replace(fn, provenance=self.name)``); False = skipped."""

    def run(self, step: StepGraph) -> TransformResult:
        regions = self.match(step)
        rewritten = sum(1 for region in regions if self.rewrite(step, region) is not False)
        step.graph_module.recompile()
        return TransformResult(step, rewritten > 0, {"matched": len(regions), "rewritten": rewritten})
