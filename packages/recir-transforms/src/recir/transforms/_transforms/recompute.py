"""``recir-recompute-activations``: forward values the backward reads are recomputed there instead of kept.

A captured step is one graph, so "saving an activation for the backward" is nothing but a forward value
with a backward reader: it stays alive from the forward to that reader. This transform gives chosen
backward readers their own copy of the forward computation, placed right before the first of them, so
the forward value dies in the forward and only the region's inputs stay alive across it.

The copies read their inputs through ``recir::recompute_barrier`` (the identity, like JAX's
``optimization_barrier``), which also waits for a value of the backward: a backend that merges identical
computations (XLA's CSE) cannot fold the copy back into the forward, nor schedule it early.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from .._errors import ConfigError
from .._graph_util import alias_chain
from .._override import register_override_op
from .._step import OVERRIDE_KEY, PHASE_KEY, RNG_MASK_KEY, SCOPE_KEY, StepGraph
from .._transform import Transform, TransformResult, register_transform
from .dce import is_random

#: On each node the transform adds (the copies and the barrier): the region it recomputes.
RECOMPUTE_KEY = "recir.recompute"
NAME = "recir-recompute-activations"
POLICIES = ("regions", "cost", "budget")


@torch.library.custom_op("recir::recompute_barrier", mutates_args=())
def recompute_barrier(xs: list[Tensor]) -> list[Tensor]:
    """The identity on ``xs`` (copies: a custom op may not alias its inputs). Lowerings make it free:
    XLA's ``optimization_barrier`` on the TPU path, the inputs themselves in Inductor."""
    return [x.clone() for x in xs]


@recompute_barrier.register_fake
def _recompute_barrier_fake(xs: list[Tensor]) -> list[Tensor]:
    return [torch.empty_like(x) for x in xs]


register_override_op("recir::recompute_barrier", NAME)

_aten = torch.ops.aten
# Products (and what runs them): what the cost policy keeps. Everything recir::* (embedding lookups,
# other overrides) and every random op is kept by every policy.
_PRODUCTS = {
    _aten.mm.default,
    _aten.bmm.default,
    _aten.addmm.default,
    _aten.baddbmm.default,
    _aten.convolution.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
}


def _bytes(node: fx.Node) -> int:
    """The bytes of ``node``'s tensor value (0 for tuples: their getitems hold the tensors)."""
    val = node.meta.get("val")
    return int(val.numel()) * val.element_size() if isinstance(val, Tensor) else 0


def transient_peak_bytes(step: StepGraph) -> int:
    """The most bytes of intermediate tensors alive at once when the graph runs in node order, each value
    freed after its last reader (a view keeps its base alive). State and batch inputs and the values the
    step returns are not counted: the interpreter's memory model, and what a compiler starts from."""
    nodes = list(step.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    returned = {b for v in step.graph.output_node().args[0] if isinstance(v, fx.Node) for b in alias_chain(v)}
    base = {n: alias_chain(n)[-1] for n in nodes if n.op == "call_function"}
    last: dict[fx.Node, int] = {}
    for n, b in base.items():
        last[b] = max(last.get(b, order[n]), *(order[u] for u in n.users), order[n])
    frees: dict[int, int] = {}
    live = peak = 0
    for i, n in enumerate(nodes):
        if base.get(n) is n and n not in returned:
            live += _bytes(n)
            frees[last[n]] = frees.get(last[n], 0) + _bytes(n)
        peak = max(peak, live)
        live -= frees.pop(i, 0)
    return peak


def _cheap(node: fx.Node) -> bool:
    """Of the recomputable nodes (getitems and aten ops), the cheap ones for the cost policy: elementwise
    ops, views, copies, reductions and norms; products are kept."""
    return node.target not in _PRODUCTS


def _recomputable(node: fx.Node, keep_rng_masks: bool) -> bool:
    if node.op != "call_function" or node.meta.get(PHASE_KEY) != "forward":
        return False
    if is_random(node) or (keep_rng_masks and node.meta.get(RNG_MASK_KEY) is not None):
        return False
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return False
    return target.namespace == "aten"  # recir::* overrides (lookups), collectives: kept


def _group(scope: str, patterns: Sequence[str]) -> str | None:
    """The shortest module path prefix of ``scope`` that one of ``patterns`` matches, or None."""
    if not scope:  # the top-level module: "*" matches it
        return "" if any(fnmatch.fnmatchcase("", p) for p in patterns) else None
    parts = scope.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if any(fnmatch.fnmatchcase(prefix, p) for p in patterns):
            return prefix
    return None


@dataclasses.dataclass
class _Plan:
    group: str
    nodes: list[fx.Node]  # the region's recomputable forward nodes, in graph order
    saved_bytes: int  # what those a backward node reads hold today


@register_transform
class Recompute(Transform):
    """Recompute chosen forward values in the backward phase instead of keeping them alive.

    Regions are module paths (``recir.scope``, set by recir-capture): ``modules`` holds fnmatch patterns
    and each distinct matching path is one region (``"layers.*"``: ``layers.0``, ``layers.1``, ... with
    their submodules). Policies:

    - ``regions``: every forward value of a region that the backward reads is recomputed from the
      region's inputs (a layer's input, its parameters): activation checkpointing per layer. The
      region's outputs stay kept (the next region's input).
    - ``cost``: only cheap values are recomputed (elementwise ops, views, copies, norms and reductions),
      products (``mm``/``bmm``/``addmm``/``baddbmm``, convolution, attention) stay kept; a value is
      recomputed only when the inputs it would newly keep are smaller than itself. Each module path
      is its own region (``modules`` restricts which).
    - ``budget``: whole regions, largest first, until the step's transient peak
      (:func:`transient_peak_bytes`) is at most ``budget_bytes`` (or every region is recomputed).

    Random ops and (``keep_rng_masks``) dropout keep masks are never recomputed: a mask costs one byte
    per element and a counter hash to redo. Embedding lookups and other ``recir::*`` ops stay kept.
    Values are unchanged: the copies run the same ops on the same inputs.

    Before (``modules=("layer",)``)::

        %mm = aten.mm(%x, %w)  # forward
        %relu = aten.relu(%mm)  # forward
        ...
        %threshold_backward = aten.threshold_backward(%g, %relu, 0)  # backward

    After::

        %mm = aten.mm(%x, %w)  # forward
        %relu = aten.relu(%mm)  # forward
        ...
        %barrier = recir.recompute_barrier([%x, %w, %g])  # backward
        %mm_1 = aten.mm(%barrier[0], %barrier[1])  # backward
        %relu_1 = aten.relu(%mm_1)  # backward
        %threshold_backward = aten.threshold_backward(%g, %relu_1, 0)  # backward
    """

    name = NAME
    summary = "recompute chosen forward values in the backward instead of keeping them"

    @dataclasses.dataclass(frozen=True)
    class Options:
        policy: str = "regions"  # "regions" | "cost" | "budget"
        modules: tuple[str, ...] = ("*",)  # fnmatch patterns of module paths; each match is one region
        budget_bytes: int | None = None  # the budget policy's target transient peak
        keep_rng_masks: bool = True

    def requires(self, step: StepGraph) -> None:
        opts = self.options
        if opts.policy not in POLICIES:
            raise ConfigError(
                f"{self.name}: policy={opts.policy!r} is not a policy. Fix: pass one of {', '.join(POLICIES)}."
            )
        if isinstance(opts.modules, str) or not opts.modules:
            raise ConfigError(
                f"{self.name}: modules={opts.modules!r} must be a non-empty tuple of module-path patterns. "
                "Fix: e.g. modules=('layers.*',) for every child of `layers`."
            )
        if (opts.policy == "budget") != (opts.budget_bytes is not None):
            raise ConfigError(
                f"{self.name}: budget_bytes={opts.budget_bytes!r} with policy={opts.policy!r}. Fix: the "
                "budget policy takes budget_bytes (a transient peak in bytes); the others take none."
            )
        if opts.budget_bytes is not None and opts.budget_bytes < 0:
            raise ConfigError(
                f"{self.name}: budget_bytes={opts.budget_bytes} is negative. Fix: pass bytes >= 0."
            )
        if not any(n.meta.get(PHASE_KEY) == "backward" for n in step.graph.nodes):
            raise ConfigError(
                f"{self.name}: the step has no backward phase, so no forward value is kept for it. "
                "Fix: recompute training steps (recir.capture.capture_train_step), not serving graphs."
            )

    def run(self, step: StepGraph) -> TransformResult:
        opts = self.options
        before = transient_peak_bytes(step)
        plans = self._plans(step)
        if opts.policy == "budget":
            plans.sort(key=lambda p: -p.saved_bytes)
        done: list[str] = []
        nodes_added = 0
        for plan in plans:
            if opts.policy == "budget" and transient_peak_bytes(step) <= int(opts.budget_bytes):
                break
            added = self._rewrite(step, plan, cost=opts.policy == "cost")
            if added:
                done.append(plan.group)
                nodes_added += added
        if done:
            step.graph_module.recompile()
        after = transient_peak_bytes(step) if done else before
        stats = {
            "regions": len(done),
            "recomputed_nodes": nodes_added,
            "peak_bytes_before": before,
            "peak_bytes_after": after,
        }
        if opts.policy == "budget":
            stats["budget_met"] = after <= int(opts.budget_bytes)
        return TransformResult(step, bool(done), stats)

    # -- planning ---------------------------------------------------------------------------------
    def _plans(self, step: StepGraph) -> list[_Plan]:
        opts = self.options
        groups: dict[str, list[fx.Node]] = {}
        for node in step.graph.nodes:
            if not _recomputable(node, opts.keep_rng_masks):
                continue
            scope = str(node.meta.get(SCOPE_KEY, ""))
            if opts.policy == "cost":
                group = scope if _group(scope, opts.modules) is not None else None
            else:
                group = _group(scope, opts.modules)
            if group is not None:
                groups.setdefault(group, []).append(node)
        plans = []
        for group, nodes in groups.items():
            read = [n for n in nodes if any(u.meta.get(PHASE_KEY) == "backward" for u in n.users)]
            if read:
                plans.append(_Plan(group, nodes, sum(_bytes(t) for t in read)))
        return plans

    # -- rewriting ----------------------------------------------------------------------------------
    def _rewrite(self, step: StepGraph, plan: _Plan, cost: bool) -> int:
        """Give the backward readers of ``plan``'s targets copies; returns how many nodes were copied."""
        members = set(plan.nodes)
        if cost:
            members = {n for n in members if _cheap(n)}
        saved = {n for n in step.graph.nodes if any(u.meta.get(PHASE_KEY) == "backward" for u in n.users)}
        # recounted per region: an earlier region's barrier may now read one of these nodes
        targets = [n for n in plan.nodes if n in saved]
        chosen: list[fx.Node] = []
        closure: set[fx.Node] = set()
        for target in targets:
            if target not in members or (not cost and self._leaves(target, plan.group)):
                continue  # a region's outputs stay kept: the next region reads them as its input
            need, frontier = self._closure(target, members)
            if cost:  # inputs and constants stay alive anyway: keeping them is free
                new = {f for f in frontier if f.op == "call_function" and f not in saved and f not in closure}
                if sum(_bytes(f) for f in new) >= _bytes(target):
                    continue  # keeping its inputs would cost more than keeping it
                saved |= new
            closure |= need
            chosen.append(target)
        if not chosen:
            return 0
        graph = step.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        readers = [u for t in chosen for u in t.users if u.meta.get(PHASE_KEY) == "backward"]
        first = min(readers, key=order.__getitem__)
        copied = sorted(closure, key=order.__getitem__)
        entries: list[fx.Node] = []
        for node in copied:
            for a in node.all_input_nodes:
                if a not in closure and a not in entries and isinstance(a.meta.get("val"), Tensor):
                    entries.append(a)
        anchor = self._anchor(first, order)
        env: dict[fx.Node, Any] = {}
        with graph.inserting_before(first):
            barrier_in = [*entries, *([anchor] if anchor is not None else [])]
            if entries:
                barrier = graph.call_function(torch.ops.recir.recompute_barrier.default, (barrier_in,))
                self._meta(barrier, [a.meta["val"] for a in barrier_in], plan.group, None)
                barrier.meta[OVERRIDE_KEY] = NAME
                for i, a in enumerate(entries):
                    item = graph.call_function(operator.getitem, (barrier, i))
                    self._meta(item, a.meta["val"], plan.group, a)
                    env[a] = item
            for node in copied:
                new = graph.node_copy(node, lambda a: env.get(a, a))
                self._meta(new, node.meta.get("val"), plan.group, node)
                env[node] = new
        for target in chosen:
            for user in [u for u in target.users if u.meta.get(PHASE_KEY) == "backward"]:
                user.replace_input_with(target, env[target])
        for node in reversed(copied):  # forward values only the backward read are dead now
            if not node.users:
                graph.erase_node(node)
        return len(copied)

    def _leaves(self, node: fx.Node, group: str) -> bool:
        """Whether a forward node of another region (or none) reads ``node``: one of the region's outputs."""
        return any(
            u.meta.get(PHASE_KEY) == "forward"
            and _group(str(u.meta.get(SCOPE_KEY, "")), self.options.modules) != group
            for u in node.users
        )

    @staticmethod
    def _closure(target: fx.Node, members: set[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]]:
        """The member nodes ``target`` is computed from, and the non-member values they read."""
        need: set[fx.Node] = set()
        frontier: set[fx.Node] = set()
        stack = [target]
        while stack:
            node = stack.pop()
            if node in need:
                continue
            need.add(node)
            for a in node.all_input_nodes:
                if a in members:
                    stack.append(a)
                else:
                    frontier.add(a)
        return need, frontier

    @staticmethod
    def _anchor(first: fx.Node, order: dict[fx.Node, int]) -> fx.Node | None:
        """A backward tensor computed before ``first``: the copies wait for it (its gradient input)."""

        def usable(n: fx.Node) -> bool:
            val = n.meta.get("val")
            return n.meta.get(PHASE_KEY) == "backward" and isinstance(val, Tensor) and val.numel() > 0

        for a in first.all_input_nodes:
            if usable(a):
                return a
        node = first.prev
        while node.op != "root" and order[node] < order[first]:
            if usable(node):
                return node
            node = node.prev
        return None

    @staticmethod
    def _meta(new: fx.Node, val: Any, group: str, source: fx.Node | None) -> None:
        new.meta = {"val": val, PHASE_KEY: "backward", RECOMPUTE_KEY: group}
        if source is not None and SCOPE_KEY in source.meta:
            new.meta[SCOPE_KEY] = source.meta[SCOPE_KEY]
        if source is not None and "stack_trace" in source.meta:
            new.meta["stack_trace"] = source.meta["stack_trace"]
