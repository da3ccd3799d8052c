"""``recir-pipeline-sparse``: a steady-state step software-pipelined over batches.

The batch-only work that feeds the sparse part of a step (the ids' input all-to-alls a recir.distributed
plan inserts, id preprocessing, lookups of tables the step never updates) does not depend on the model
state, so batch ``i + 1``'s share of it can run during batch ``i``'s step: the rewritten step takes batch
``i + stages - 1``, trains on batch ``i`` from values carried in state (``carry:<stage>:<name>`` slots),
and returns the new batch's values as the last stage's new carry. Nothing that reads updated state
moves, so the pipelined run is exact (equal to the unpipelined one), never stale.

Before (one device of a row-wise sharded table)::

    %ids_all = wait(all_to_all_single(%ids, ...))          # forward, waits for the other devices
    %rows = recir.embedding_bag(%T, %ids_all, ...)
    ...
    return [%T_new, ..., %loss]

After (``stages=2``)::

    %a2a = all_to_all_single(%ids, ...)                    # batch i+1's ids go out, early
    %rows = recir.embedding_bag(%T, %carry_0_ids_all, ...)  # batch i's ids arrived during step i-1
    ...
    %ids_all_next = wait(%a2a)                             # waited for last: overlaps batch i's compute
    return [%T_new, ..., %ids_all_next, %loss]

The transform returns the steady step; its ``meta[PIPELINE_SPARSE_KEY]`` holds the prologue (the same
state layout, only the carry of one new batch) that :class:`recir.transforms.PipelinedStep` runs for the
first ``stages - 1`` batches. The last batches drain by re-running the steady step on the last batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx as fx

from .._errors import ConfigError
from .._signature import Signature, StateSlot
from .._slot_names import carry_slot
from .._step import OVERRIDE_KEY, PHASE_KEY, StepGraph
from .._transform import Transform, TransformResult, register_transform
from .dce import is_random

NAME = "recir-pipeline-sparse"
PIPELINE_SPARSE_KEY = "recir.pipeline_sparse"
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional")
_WAIT = "wait_tensor"


@dataclasses.dataclass(frozen=True)
class SparsePipelineInfo:
    """What ``recir-pipeline-sparse`` made: the stage count, the carried values (one ``carry`` slot per
    value and stage), the nodes computed one or more batches ahead, and the prologue step."""

    stages: int
    carried: tuple[str, ...]
    moved: tuple[str, ...]
    prologue: StepGraph


@register_transform
class PipelineSparse(Transform):
    """Move the state-independent work of the sparse path one or more batches ahead (see the module doc).

    What moves: every node computed only from the batch (and from state the step never updates) that
    is, or feeds, a collective or an override op (an embedding lookup), e.g. the ids' all-to-all and
    the id arithmetic before it. What is carried: each moved value a remaining node reads, plus the raw
    batch tensors the remaining nodes read (labels, dense features), for ``stages - 1`` batches.
    Stats: ``moved`` nodes, ``collectives`` among them, ``carried`` values and ``carry_bytes`` per stage.
    A step with nothing to move is returned unchanged (``reason`` says why).
    """

    name = NAME
    summary = (
        "software-pipeline the batch-only sparse work (ids' all-to-alls, id math) stages-1 batches ahead"
    )

    @dataclasses.dataclass(frozen=True)
    class Options:
        stages: int = 2

        def __post_init__(self) -> None:
            if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 2:
                raise ConfigError(
                    f"{NAME}: stages must be an int >= 2 (2 = compute batch i+1's sparse inputs during "
                    f"batch i), got {self.stages!r}. Fix: pass stages=2, or do not pipeline."
                )

    def requires(self, step: StepGraph) -> None:
        if PIPELINE_SPARSE_KEY in step.meta:
            raise ConfigError(
                f"{NAME}: the step is already pipelined ({step.meta[PIPELINE_SPARSE_KEY].stages} stages). "
                "Fix: pipeline the unpipelined step once, with the stage count you want."
            )
        if step.dynamic:
            raise ConfigError(
                f"{NAME}: the step has dynamic shapes; carried values need static shapes to live in state. "
                "Fix: capture with mode='static' (pad or bucket the batches)."
            )

    def run(self, step: StepGraph) -> TransformResult:
        cut = _Cut(step)
        if not cut.moved:
            return TransformResult(step, False, {"moved": 0, "reason": cut.reason})
        k = self.options.stages
        steady = _build(step, cut, k, prologue=False)
        prologue = _build(step, cut, k, prologue=True)
        info = SparsePipelineInfo(
            stages=k,
            carried=tuple(n.name for n in cut.frontier),
            moved=tuple(n.name for n in cut.moved),
            prologue=prologue,
        )
        steady.meta[PIPELINE_SPARSE_KEY] = info
        nbytes = sum(_nbytes(n) for n in cut.frontier)
        stats = {
            "stages": k,
            "moved": len(cut.moved),
            "collectives": sum(1 for n in cut.moved if _is_collective(n) and not _is_wait(n)),
            "carried": len(cut.frontier),
            "carry_bytes": nbytes * (k - 1),
        }
        return TransformResult(steady, True, stats)


class _Cut:
    """Which nodes move ahead (``moved``, graph order) and which values cross the cut (``frontier``)."""

    def __init__(self, step: StepGraph) -> None:
        graph = step.graph
        phs = [n for n in graph.nodes if n.op == "placeholder"]
        n_state = len(step.signature.state)
        self.state_phs, self.batch_phs = phs[:n_state], phs[n_state:]
        self.output = next(n for n in graph.nodes if n.op == "output")
        outs = list(self.output.args[0])
        readonly = {ph for i, ph in enumerate(self.state_phs) if outs[i] is ph}
        free: set[fx.Node] = set(self.batch_phs) | readonly  # computable without updated state
        batch_dep: set[fx.Node] = set(self.batch_phs)
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            inputs = node.all_input_nodes
            if all(i in free for i in inputs) and not is_random(node):
                free.add(node)
            if any(i in batch_dep for i in inputs):
                batch_dep.add(node)
        ahead = {n for n in free & batch_dep if n.op == "call_function"}
        anchors = {n for n in ahead if _is_sparse(n)}
        for node in graph.nodes:
            if node.op == "call_function" and _is_sparse(node):
                anchors.update(i for i in node.all_input_nodes if i in ahead)
        moved = _ancestors(anchors, ahead)
        self.reason = (
            "no batch-only collective, lookup or id computation feeds the sparse path" if not moved else ""
        )
        # A value crossing the cut must be a tensor (it lives in a state slot), else it (and what it feeds)
        # stays in the step; a view read only by the step stays too (its base is carried once, not each
        # view). A view that moved nodes read as well moves: they must see the new batch's value.
        while True:
            frontier = self._frontier(graph, moved)
            bad = [n for n in frontier if not isinstance(n.meta.get("val"), torch.Tensor)]
            if bad:
                moved -= _descendants(bad, moved)
                continue
            views = [
                n
                for n in frontier
                if n in moved and _is_view(n) and n.all_input_nodes and not any(u in moved for u in n.users)
            ]
            if not views:
                break
            moved -= set(views)
        for node in moved:  # each moved node reads moved nodes, the batch, or batch-independent values only
            late = [
                i
                for i in node.all_input_nodes
                if i in batch_dep and i not in moved and i not in self.batch_phs
            ]
            if late:
                raise AssertionError(f"{NAME}: %{node.name} would read this batch's %{late[0].name}")
        self.moved = [n for n in graph.nodes if n in moved]
        self.frontier = self._frontier(graph, moved)
        if not self.moved:
            self.reason = self.reason or "every batch-only value feeding the sparse path is a non-tensor"

    def _frontier(self, graph: fx.Graph, moved: set[fx.Node]) -> list[fx.Node]:
        return [
            n
            for n in graph.nodes
            if (n in moved or n in self.batch_phs) and any(u not in moved for u in n.users)
        ]


def _build(step: StepGraph, cut: _Cut, k: int, *, prologue: bool) -> StepGraph:
    """The steady step (train on carry 0, compute the new batch's carry) or the prologue (carry only)."""
    src = step.graph
    g = fx.Graph()
    cur: dict[fx.Node, fx.Node] = {}  # this call's training program
    nxt: dict[fx.Node, fx.Node] = {}  # the new batch's moved nodes
    for ph in cut.state_phs:
        cur[ph] = _placeholder(g, ph.name, ph.meta)
    carries = [
        {f: _placeholder(g, f"carry_{j}_{f.name}", {"val": f.meta["val"]}) for f in cut.frontier}
        for j in range(k - 1)
    ]
    for ph in cut.batch_phs:
        nxt[ph] = _placeholder(g, ph.name, ph.meta)
    moved = set(cut.moved)
    cur.update(carries[0])
    late = _descendants([n for n in cut.moved if _is_wait(n)], moved)
    needed = _inputs_outside(cut.moved, moved, set(cut.batch_phs)) if prologue else None

    def arg_next(a: fx.Node) -> fx.Node:
        return nxt[a] if a in nxt else cur[a]

    for node in src.nodes:
        if node.op != "call_function":
            continue
        if node in moved:
            if node not in late:
                nxt[node] = g.node_copy(node, arg_next)
        elif needed is None or node in needed:
            cur[node] = g.node_copy(node, lambda a: cur[a])
    for node in src.nodes:
        if node in late:
            nxt[node] = g.node_copy(node, arg_next)
    outs = list(cut.output.args[0])
    n_state = len(cut.state_phs)
    if prologue:
        new_state = [cur[ph] for ph in cut.state_phs]
        user_outs: list[Any] = []
    else:
        new_state = [_map(o, cur) for o in outs[:n_state]]
        user_outs = [_map(o, cur) for o in outs[n_state:]]
    for j in range(k - 1):
        for f in cut.frontier:
            value = carries[j + 1][f] if j + 1 < k - 1 else nxt[f]
            if value.op == "placeholder" or _is_view(value):  # an input, or a view of one: a copy (INV-2)
                value = g.call_function(torch.ops.aten.clone.default, (value,))
                value.meta.update(val=f.meta["val"], **{PHASE_KEY: "forward"})
            new_state.append(value)
    g.output(tuple(new_state + user_outs))
    g.lint()
    gm = fx.GraphModule(step.graph_module, g)
    slots = tuple(
        StateSlot(carry_slot(j, f.name), "carry", tuple(f.meta["val"].shape), f.meta["val"].dtype)
        for j in range(k - 1)
        for f in cut.frontier
    )
    sig = step.signature
    signature = Signature(
        (*sig.state, *slots),
        sig.batch,
        () if prologue else sig.outputs,
        sig.batch_spec,
        None if prologue else sig.output_spec,
    )
    meta = {key: value for key, value in step.meta.items() if key != PIPELINE_SPARSE_KEY}
    return step.replace(
        graph_module=gm,
        signature=signature,
        initializers=(zero_carry_initializer, *step.initializers),
        meta=meta,
    )


def zero_carry_initializer(slot: StateSlot, model: Any, optimizer: Any) -> torch.Tensor | None:
    """``carry:*`` slots start as zeros (the prologue fills them before the steady step reads them)."""
    if slot.kind != "carry":
        return None
    return torch.zeros(slot.shape, dtype=slot.dtype)


def _placeholder(g: fx.Graph, name: str, meta: dict[str, Any]) -> fx.Node:
    node = g.placeholder(name)
    node.meta.update({key: value for key, value in meta.items() if key != PHASE_KEY})
    return node


def _map(value: Any, env: dict[fx.Node, fx.Node]) -> Any:
    return env[value] if isinstance(value, fx.Node) else value


def _inputs_outside(nodes: Iterable[fx.Node], inside: set[fx.Node], batch: set[fx.Node]) -> set[fx.Node]:
    """Compute nodes outside ``inside`` (constants) that ``nodes`` read, with their own such inputs."""
    out: set[fx.Node] = set()
    todo = [i for n in nodes for i in n.all_input_nodes if i not in inside and i not in batch]
    while todo:
        node = todo.pop()
        if node in out or node.op != "call_function":
            continue
        out.add(node)
        todo.extend(node.all_input_nodes)
    return out


def _ancestors(roots: Iterable[fx.Node], within: set[fx.Node]) -> set[fx.Node]:
    return _closure(roots, within, lambda n: n.all_input_nodes)


def _descendants(roots: Iterable[fx.Node], within: set[fx.Node]) -> set[fx.Node]:
    return _closure(roots, within, lambda n: n.users)


def _closure(
    roots: Iterable[fx.Node], within: set[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]]
) -> set[fx.Node]:
    """``roots`` (those in ``within``) and every node of ``within`` reachable from them by ``step``."""
    out: set[fx.Node] = set()
    todo = [r for r in roots if r in within]
    while todo:
        node = todo.pop()
        if node in out:
            continue
        out.add(node)
        todo.extend(n for n in step(node) if n in within)
    return out


def _is_collective(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.namespace in _COLLECTIVE_NAMESPACES


def _is_wait(node: fx.Node) -> bool:
    return _is_collective(node) and node.target._overloadpacket.__name__ == _WAIT  # type: ignore[union-attr]


def _is_view(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def _is_sparse(node: fx.Node) -> bool:
    """A collective, or a recir:: op (recir::embedding_bag and the other lookups, the id checks)."""
    target = node.target
    if _is_collective(node):
        return True
    return node.meta.get(OVERRIDE_KEY) is not None or (
        isinstance(target, torch._ops.OpOverload) and target.namespace == "recir"
    )


def _nbytes(node: fx.Node) -> int:
    val = node.meta["val"]
    return int(val.numel()) * val.element_size()
