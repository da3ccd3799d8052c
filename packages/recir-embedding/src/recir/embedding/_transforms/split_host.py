"""recir-embed-split-host: the StepGraph cut at the embedding boundary, so that tables live on the host.

``SplitHostEmbeddings`` marks the host regions of a prepared step (the tables' lookups; their sparse row
updates), and ``split_host`` cuts the marked step into three StepGraphs that a runtime chains each step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch
import torch.fx as fx
from recir.transforms import (
    OPTIMIZER_KEY,
    PHASE_KEY,
    REGION_KEY,
    BatchSlot,
    ConfigError,
    OutputSlot,
    Region,
    RegionTransform,
    Signature,
    StepGraph,
    TransformResult,
    register_transform,
)

from .sparsify_update import ROW_GRAD_KEY, embedding_tables

aten = torch.ops.aten
HOST_LOOKUP = "recir.host:lookup"
HOST_UPDATE = "recir.host:update"
#: ``step.meta`` key: what SplitHostEmbeddings decided, as plain data (node and slot names).
HOST_SPLIT_KEY = "recir.host_split"
_LOOKUP_OPS = {torch.ops.recir.embedding_bag.default, torch.ops.recir.embedding.default}
_SAME = {aten.detach.default, aten.alias.default, aten.clone.default}
# the per-id plumbing of recir::embedding_bag's gradient formula between the pooled rows' gradient and
# the per-id rows the update reads: index_select(grad, 0, bag) [/ bag sizes] [* per-sample weights]
_PER_ID = {aten.mul.Tensor, aten.div.Tensor, aten._to_copy.default, aten.clone.default}


def _ancestors(roots: Iterable[fx.Node], stop: set[fx.Node] | None = None) -> set[fx.Node]:
    """``roots`` and every node they read, not walking past the nodes in ``stop`` (which are included)."""
    seen: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if stop is None or n not in stop:
            todo.extend(n.all_input_nodes)
    return seen


def _row_grad_source(g: fx.Node, lookup: fx.Node | None) -> fx.Node:
    """The gradient w.r.t. a lookup's rows, from the per-id gradient its table's update reads.

    A sequence lookup's (``recir::embedding``) per-id gradient is its rows' gradient. A pooled lookup's
    (``recir::embedding_bag``) is ``index_select(grad_rows, 0, bag_of_id)``, divided by bag sizes (mean)
    and times per-sample weights: walk back to ``grad_rows`` ([bags, D]), so that the device sends the
    pooled rows' gradient and the per-id expansion runs on the host. Anything else: ``g`` itself.
    """
    if lookup is None or lookup.target != torch.ops.recir.embedding_bag.default:
        return g
    n = g
    for _ in range(6):
        if n.op != "call_function":
            break
        if n.target == aten.index_select.default and n.args[1] == 0 and isinstance(n.args[0], fx.Node):
            rows = n.args[0].meta.get("val")
            ok = isinstance(rows, torch.Tensor) and rows.shape == lookup.meta["val"].shape
            return n.args[0] if ok else g
        if n.target in _PER_ID and isinstance(n.args[0], fx.Node):
            n = n.args[0]
            continue
        break
    return g


@dataclasses.dataclass
class _Plan:
    tables: dict[str, list[str]]  # table slot -> [table slot, its optimizer-state slots]
    lookups: list[fx.Node]
    update: list[fx.Node]
    row_grads: list[fx.Node]
    exported: list[fx.Node]
    skipped: dict[str, str]
    lookup_tables: list[str]  # per lookup: its table slot
    lookup_grads: dict[fx.Node, fx.Node]  # lookup -> the gradient w.r.t. its output, where the step has one


def _plan(step: StepGraph, only: Sequence[str] | None) -> _Plan:
    sig = step.signature
    names = sig.state_names()
    n_state = len(names)
    placeholders = [n for n in step.graph.nodes if n.op == "placeholder"]
    output = step.graph.output_node()
    outs = list(output.args[0])
    optim = step.meta.get(OPTIMIZER_KEY, {})
    tagged: dict[str, list[tuple[fx.Node, str]]] = {}
    for node in step.graph.nodes:
        for slot, ids in node.meta.get(ROW_GRAD_KEY, ()):
            tagged.setdefault(slot, []).append((node, ids))
    batch_only: set[fx.Node] = set(placeholders[n_state:])
    for node in step.graph.nodes:
        if node.op == "call_function" and all(a in batch_only for a in node.all_input_nodes):
            batch_only.add(node)

    skipped: dict[str, str] = {}
    tables: dict[str, list[str]] = {}
    lookups: list[fx.Node] = []
    lookup_tables: list[str] = []
    for slot in embedding_tables(step):
        if only is not None and slot not in only:
            continue
        if slot not in tagged:
            skipped[slot] = (
                "its update is dense (recir-embed-sparsify-update left it), so it stays on the device"
            )
            continue
        ph = placeholders[names.index(slot)]
        mine = [u for u in _readers(ph) if u.target in _LOOKUP_OPS and u.meta.get(PHASE_KEY) == "forward"]
        bad = [u for u in mine if not all(a in batch_only for a in u.all_input_nodes[1:])]
        if bad:
            skipped[slot] = f"lookup %{bad[0].name} reads ids computed in the step, not from the batch"
            continue
        tables[slot] = [slot, *optim.get(slot, {}).get("state", {}).values()]
        lookups += mine
        lookup_tables += [slot] * len(mine)
    if only is not None and (missing := sorted(set(only) - set(tables) - set(skipped))):
        raise ConfigError(f"recir-embed-split-host: {missing} are no embedding tables of this step")

    host_slots = {s for slots in tables.values() for s in slots}
    host_idx = [i for i, name in enumerate(names) if name in host_slots]
    row_grads_: dict[fx.Node, None] = {}
    lookup_grads: dict[fx.Node, fx.Node] = {}
    for t in tables:
        by_ids = {
            u.args[1].name: u
            for u, s in zip(lookups, lookup_tables)
            if s == t and isinstance(u.args[1], fx.Node)
        }
        for g, ids in tagged[t]:
            lk = by_ids.get(ids)
            src = _row_grad_source(g, lk)
            row_grads_[src] = None
            # the gradient w.r.t. the lookup's output: a sequence lookup's per-id gradient is its rows'; a
            # bag's only when walked back to the pooled rows (else it stays per id: no output gradient)
            if lk is not None and (lk.target != torch.ops.recir.embedding_bag.default or src is not g):
                lookup_grads[lk] = src
    row_grads = list(row_grads_)
    device_roots = [v for i, v in enumerate(outs) if i >= n_state or names[i] not in host_slots]
    stop = set(lookups)
    device = _ancestors([*device_roots, *row_grads], stop) - stop
    lookup_args = _ancestors([a for u in lookups for a in u.all_input_nodes], None)
    host_roots = [outs[i] for i in host_idx]
    host_slice = _ancestors(host_roots, device | stop | lookup_args)
    update = [
        n
        for n in step.graph.nodes
        if n in host_slice
        and n.op == "call_function"
        and n not in device
        and n not in stop
        and n not in lookup_args
        and n not in batch_only
    ]
    members = set(update)
    entries = {a: None for n in update for a in n.all_input_nodes if a not in members}
    exported = [
        a
        for a in entries
        if a not in batch_only and not (a.op == "placeholder" and names[placeholders.index(a)] in host_slots)
    ]
    exported = [*row_grads, *(a for a in exported if a not in row_grads)]
    for i in host_idx:  # a host slot's new value computed on the device (not row-wise): keep it there
        if outs[i] in device:
            raise ConfigError(
                f"recir-embed-split-host: the new value of host slot {names[i]!r} is computed by the device "
                f"part (%{outs[i].name}). Fix: leave this table on the device (SplitHostEmbeddings(tables=...))."
            )
    return _Plan(tables, lookups, update, row_grads, exported, skipped, lookup_tables, lookup_grads)


def _readers(ph: fx.Node) -> list[fx.Node]:
    """The nodes reading ``ph`` directly or through detach/alias/clone."""
    out, todo = [], [ph]
    while todo:
        n = todo.pop()
        for u in n.users:
            out.append(u)
            if u.op == "call_function" and u.target in _SAME:
                todo.append(u)
    return out


@register_transform
class SplitHostEmbeddings(RegionTransform):
    """Mark the host regions of a prepared step: tables' lookups and their sparse row updates.

    Runs after ``recir-embed-sparsify-update`` (it starts from the per-id gradient terms that transform
    tags) and before an embedding backend rewrites the lookups. Per step it finds two regions and adds
    their id to the nodes' ``recir.region``: ``recir.host:lookup`` (every ``recir::embedding_bag`` /
    ``recir::embedding`` reading a sparsified table) and ``recir.host:update`` (those tables' row
    updates, with the per-id expansion of each lookup's row gradient). It records the split in
    ``step.meta["recir.host_split"]`` (plain names): host tables and their optimizer-state slots, the
    lookups, the row gradients and every other value the update reads from the device (the new
    ``optim:step``, the learning rate). The graph itself is unchanged; ``split_host`` cuts it::

        %rows = recir.embedding_bag(%W, %ids, %offs, None, 0)   # forward   [recir.host:lookup]
        %h = mm(%rows, %w1) ...                                  # dense forward/backward
        %g_rows = mm(%g_h, %w1_t)                                # the rows' gradient (device)
        %per_id = index_select(%g_rows, 0, %bag)                 # backward  [recir.host:update]
        %W1 = index_put(%W, [%r], where(%valid, ...), True)      # optimizer [recir.host:update]

    Batch-only values (ids, offsets, bag indices) belong to neither region: each part recomputes them
    from the batch. Tables whose update stayed dense, or whose lookups read ids computed in the step,
    stay on the device (``stats["skipped"]`` says why). ``tables``: only these table slots (default all).
    """

    name = "recir-embed-split-host"
    summary = "mark tables' lookups and sparse row updates as host regions (the embedding boundary)"

    @dataclasses.dataclass(frozen=True)
    class Options:
        tables: tuple[str, ...] | None = None

    def requires(self, step: StepGraph) -> None:
        if OPTIMIZER_KEY not in step.meta:
            raise ConfigError(
                f"{self.name}: the step has no meta[{OPTIMIZER_KEY!r}]; capture it with "
                "recir.capture.capture_train_step and run recir-embed-sparsify-update first"
            )

    def match(self, step: StepGraph) -> list[Region]:
        plan = _plan(step, self.options.tables)
        self._plan = plan
        step.meta[HOST_SPLIT_KEY] = {
            "tables": plan.tables,
            "lookups": [n.name for n in plan.lookups],
            "lookup_tables": list(plan.lookup_tables),
            "lookup_grads": {k.name: v.name for k, v in plan.lookup_grads.items()},
            "row_grads": [n.name for n in plan.row_grads],
            "exported": [n.name for n in plan.exported],
            "skipped": plan.skipped,
        }
        regions = []
        if plan.lookups:
            regions.append(Region(step, plan.lookups, HOST_LOOKUP))
        if plan.update:
            regions.append(Region(step, plan.update, HOST_UPDATE))
        return regions

    def rewrite(self, step: StepGraph, region: Region) -> bool:
        for node in region.nodes:
            ids = list(node.meta.get(REGION_KEY) or ())
            if region.name not in ids:
                node.meta[REGION_KEY] = [*ids, region.name]
        return True

    def run(self, step: StepGraph) -> TransformResult:
        result = super().run(step)
        plan = self._plan
        stats = {
            **result.stats,
            "tables": sorted(plan.tables),
            "lookups": len(plan.lookups),
            "row_grads": len(plan.row_grads),
            "exported": len(plan.exported),
            "skipped": plan.skipped,
        }
        return TransformResult(result.step, result.changed, stats)


@dataclasses.dataclass
class HostSplit:
    """A step cut at the embedding boundary: three StepGraphs a runtime chains every step.

    - ``lookup``: ``(host state, batch) -> (host state unchanged, rows...)``, one output per lookup.
    - ``device``: ``(device state, batch + rows) -> (new device state, outputs + boundary)``: everything
      else; ``boundary`` is the gradient w.r.t. each row output (``row_grads`` of them, first) and the
      other values the update reads (the new ``optim:step``, learning rates).
    - ``update``: ``(host state, batch + boundary) -> new host state``: the tables' row-wise updates.

    ``host_slots`` / ``device_slots`` index ``step.signature.state``: the full step's state is their
    union, so checkpoints are the same as an unsplit step's. ``tables`` maps each host table slot to its
    slots (the table, then its optimizer state).

    A fused lookup + backward + optimizer kernel takes the host parts' place (``recir.embedding.FusedTBE``,
    FBGEMM's split TBE on the GPU path): its forward is ``lookup`` (the rows), and its backward, given the
    row gradients that ``device`` returns (pooled ``[bags, D]`` for bags, the rows' for sequences: exactly
    TBE's ``grad_output``; ``lookup_grads`` says which is whose), applies the optimizer of
    ``step.meta[OPTIMIZER_KEY][table]`` in place, i.e. ``update``.
    """

    step: StepGraph
    lookup: StepGraph
    device: StepGraph
    update: StepGraph
    host_slots: list[int]
    device_slots: list[int]
    tables: dict[str, list[str]]
    row_grads: int
    #: per lookup (the order of ``lookup``'s row outputs): its table slot
    lookup_tables: list[str] = dataclasses.field(default_factory=list)
    #: per lookup: the index among ``device``'s boundary row gradients of the gradient w.r.t. its rows, or
    #: None when the device returns per-id gradients for it (a bag whose pooling could not be walked back)
    lookup_grads: list[int | None] = dataclasses.field(default_factory=list)


def split_host(step: StepGraph) -> HostSplit:
    """Cut a step marked by ``SplitHostEmbeddings`` into its host lookup, device and host update parts.

    Never mutates ``step``. Raises ``ConfigError`` if the step is unmarked or has no host table.
    """
    info = step.meta.get(HOST_SPLIT_KEY)
    if info is None:
        raise ConfigError(
            "split_host: the step has no meta['recir.host_split']. Fix: run SplitHostEmbeddings first "
            "(prepare_for_lowering(step, backend='cpu') does)."
        )
    if not info["tables"]:
        reasons = (
            "; ".join(f"{k}: {v}" for k, v in info["skipped"].items()) or "the step has no embedding table"
        )
        raise ConfigError(
            f"split_host: no table can live on the host ({reasons}). Fix: use embedding_backend='in_graph', "
            "or keep sparse_updates on (host tables are updated row-wise)."
        )
    sig = step.signature
    names = sig.state_names()
    n_state = len(names)
    by_name = {n.name: n for n in step.graph.nodes}
    placeholders = [n for n in step.graph.nodes if n.op == "placeholder"]
    outs = list(step.graph.output_node().args[0])
    host_set = {s for slots in info["tables"].values() for s in slots}
    host_idx = [i for i, name in enumerate(names) if name in host_set]
    dev_idx = [i for i in range(n_state) if i not in host_idx]
    lookups = [by_name[n] for n in info["lookups"]]
    exported = [by_name[n] for n in info["exported"]]
    batch_phs = placeholders[n_state:]

    def slot(node: fx.Node, name: str) -> BatchSlot:
        val = node.meta["val"]
        return BatchSlot(name, tuple(val.shape), val.dtype, "other")

    def out_slot(node: fx.Node, name: str) -> OutputSlot:
        val = node.meta["val"]
        return OutputSlot(name, tuple(val.shape), val.dtype)

    host_state = tuple(sig.state[i] for i in host_idx)
    row_names = [f"rows:{n.name}" for n in lookups]
    bnd_names = [
        f"grad:{n.name}" if k < len(info["row_grads"]) else f"value:{n.name}" for k, n in enumerate(exported)
    ]

    # host lookup: (host state, batch) -> (host state, rows)
    g, env = _graph_with_inputs(step, [placeholders[i] for i in host_idx] + batch_phs, [])
    _copy_slice(step, g, env, lookups)
    g.output(tuple([env[placeholders[i]] for i in host_idx] + [env[n] for n in lookups]))
    lookup = _part(
        step,
        g,
        Signature(
            host_state, sig.batch, tuple(out_slot(n, r) for n, r in zip(lookups, row_names)), sig.batch_spec
        ),
    )

    # device: (device state, batch + rows) -> (device state, outputs + boundary)
    g, env = _graph_with_inputs(step, [placeholders[i] for i in dev_idx] + batch_phs, lookups)
    roots = [outs[i] for i in dev_idx] + outs[n_state:] + exported
    _copy_slice(step, g, env, roots)
    # fresh buffers: a boundary value may be a state input or output (the lr, the new step counter)
    bnd = []
    for n in exported:
        c = g.call_function(aten.clone.default, (env[n],))
        c.meta = {"val": n.meta["val"], PHASE_KEY: "optimizer"}
        bnd.append(c)
    g.output(tuple([env[v] for v in roots[: len(dev_idx) + len(sig.outputs)]] + bnd))
    device = _part(
        step,
        g,
        Signature(
            tuple(sig.state[i] for i in dev_idx),
            sig.batch + tuple(slot(n, r) for n, r in zip(lookups, row_names)),
            sig.outputs + tuple(out_slot(n, b) for n, b in zip(exported, bnd_names)),
        ),
    )

    # host update: (host state, batch + boundary) -> host state
    g, env = _graph_with_inputs(step, [placeholders[i] for i in host_idx] + batch_phs, exported)
    _copy_slice(step, g, env, [outs[i] for i in host_idx])
    g.output(tuple(env[outs[i]] for i in host_idx))
    update = _part(
        step,
        g,
        Signature(host_state, sig.batch + tuple(slot(n, b) for n, b in zip(exported, bnd_names)), (), None),
    )
    grad_index = {name: k for k, name in enumerate(info["row_grads"])}
    lookup_grads = [grad_index.get(info["lookup_grads"].get(n.name, "")) for n in lookups]
    return HostSplit(
        step,
        lookup,
        device,
        update,
        host_idx,
        dev_idx,
        dict(info["tables"]),
        len(info["row_grads"]),
        list(info["lookup_tables"]),
        lookup_grads,
    )


def _graph_with_inputs(
    step: StepGraph, phs: list[fx.Node], extra: list[fx.Node]
) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """A new graph with a placeholder per node of ``phs`` then of ``extra`` (values becoming inputs)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in [*phs, *extra]:
        ph = g.placeholder(n.name if n.op == "placeholder" else f"in_{n.name}")
        ph.meta = {"val": n.meta.get("val")}
        env[n] = ph
    return g, env


def _copy_slice(step: StepGraph, g: fx.Graph, env: dict[fx.Node, fx.Node], roots: Sequence[fx.Node]) -> None:
    """Copy into ``g`` every node ``roots`` need that ``env`` does not provide yet, in graph order."""
    needed = _ancestors(roots, set(env))
    for node in step.graph.nodes:
        if node not in needed or node in env:
            continue
        if node.op != "call_function":
            raise ConfigError(
                f"split_host: %{node.name} ({node.op}) is needed by a part that does not own it; "
                "the split is inconsistent (a bug in recir-embed-split-host)"
            )
        env[node] = g.node_copy(node, env.__getitem__)


def _part(step: StepGraph, g: fx.Graph, signature: Signature) -> StepGraph:
    g.lint()
    return step.replace(graph_module=fx.GraphModule(step.graph_module, g), signature=signature)
