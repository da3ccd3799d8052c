"""``recir-dist-shard-tables``: sharded embedding tables with all-to-alls (TorchRec-style input/output dist).
Handles pooled ``recir::embedding_bag`` and unpooled ``recir::embedding`` (recir-embedding) lookups.

Each device sends its ids (and offsets, per-sample weights) to the devices holding the table, they look up
and pool for every source device, and an all-to-all returns the pooled rows; in the backward the per-id
gradients travel the same way and each holder accumulates the rows it owns::

    %e = recir.embedding_bag(%T, %ids, %offs, None, 0)      %ids_all = wait(all_to_all_single(%ids, ...))
    ...                                               ->    %part_k = recir.embedding_bag(%T, %ids_k, %offs_k, ...)
    %gT = index_add(%zeros, 0, %ids, %per_id)               %e = wait(all_to_all_single(cat(%part_*), ...))
                                                            %g_all = wait(all_to_all_single(%per_id, ...))
                                                            %gT = index_add(%zeros_local, 0, %ids_all, div(%g_all, D))

Table-wise tables travel with uneven splits (everything to the owner); row- and column-wise with even splits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.fx as fx
from recir.transforms import (
    GRAD_OF_KEY,
    OVERRIDE_KEY,
    PHASE_KEY,
    SHARDING_KEY,
    ConfigError,
    StepGraph,
    TransformResult,
    register_transform,
)

from .._graphinfo import aliases_of, lookup_ops, lookups_of, optim_slots_of, state_placeholders
from .._rewrite import C10D, call, collective, repropagate, with_local_state
from ._common import PlanTransform

aten = torch.ops.aten
_SCHEMES = ("table_wise", "row_wise", "column_wise")


@register_transform
class ShardTables(PlanTransform):
    name: ClassVar[str] = "recir-dist-shard-tables"
    summary: ClassVar[str] = (
        "embedding input/output all-to-all for table-, row- and column-wise sharded tables"
    )
    count_stat: ClassVar[str] = "sharded_tables"

    def targets(self, step: StepGraph) -> list[str]:
        plan = self.options.plan
        return [t for t in plan.tables if plan.slots[t].get("scheme") in _SCHEMES]

    def check_targets(self, step: StepGraph, targets: Sequence[str]) -> None:
        for table in targets:
            if not lookups_of(step, table):
                raise ConfigError(
                    f"{self.name}: table {table!r} is sharded but no recir::embedding_bag or recir::embedding reads it (an aten "
                    "embedding op cannot be sharded). Fix: capture with recir.embedding.overrides(), or "
                    "use FullyShardedDataParallel / DataParallel for this table."
                )

    def rewrite(self, step: StepGraph, targets: Sequence[str]) -> TransformResult:
        plan, rank = self.options.plan, self.options.rank
        claimed: dict[fx.Node, str] = {}
        lookups = 0
        for table in targets:
            for lookup in lookups_of(step, table):
                _Rewrite(step, table, lookup, plan, rank, self.name, claimed).apply()
                lookups += 1
            _check_only_lookups(step, table, self.name)
        local = {table: plan.local_shape(table, rank) for table in targets}
        for table in targets:
            local.update({o.name: plan.local_shape(o.name, rank) for o in optim_slots_of(step, table)})
        step.graph.eliminate_dead_code()
        step = with_local_state(step, local)
        repropagate(step, self.name)
        return TransformResult(step, True, {"sharded_tables": len(targets), "lookups": lookups})


class _Rewrite:
    """One lookup of one sharded table on one device: the forward dist, the local lookups, the backward dist."""

    def __init__(self, step, table, lookup, plan, rank, name, claimed) -> None:  # noqa: ANN001
        self.step, self.table, self.lookup, self.rank, self.name = step, table, lookup, rank, name
        self.graph: fx.Graph = step.graph
        self.sh: dict[str, Any] = plan.slots[table]
        self.group = plan.group_name
        self.d = plan.world_size
        self.scheme = self.sh["scheme"]
        self.holders = [self.sh["owner"]] if self.scheme == "table_wise" else list(range(self.d))
        self.rows, self.dim = plan.shapes[table][0], plan.shapes[table][1]
        self.local_rows, self.local_dim = plan.local_shape(table, rank)
        self.claimed = claimed

    def a2a(self, x: fx.Node, out_splits: list[int], in_splits: list[int], phase: str, role: str) -> fx.Node:
        return collective(
            self.graph,
            C10D.all_to_all_single.default,
            (x, out_splits, in_splits, self.group),
            phase=phase,
            sharding={**self.sh, "role": role, "table": self.table},
        )

    def send_to_holders(self, x: fx.Node, n: int, phase: str, role: str) -> fx.Node:
        """Every device sends ``x`` (``n`` rows) to each holder; a holder receives ``d * n`` rows."""
        g = self.graph
        k = len(self.holders)
        payload = x if k == 1 else call(g, aten.repeat.default, x, [k] + [1] * (_ndim(x) - 1), phase=phase)
        in_splits = [n if j in self.holders else 0 for j in range(self.d)]
        out_splits = [n if self.rank in self.holders else 0] * self.d
        return self.a2a(payload, out_splits, in_splits, phase, role)

    def apply(self) -> None:
        g, lk = self.graph, self.lookup
        pooled_op = lk.target is torch.ops.recir.embedding_bag.default
        if pooled_op:
            weight, ids, offs, psw, mode = (list(lk.args) + [None] * 5)[:5]
        else:  # recir::embedding(weight, ids): one row per id, so "bags" are the ids themselves
            (weight, ids), offs, psw, mode = lk.args[:2], None, None, 0
        n = _shape(ids)[0]
        b = _shape(offs)[0] - 1 if offs is not None else n
        holder = self.rank in self.holders
        with g.inserting_before(lk):
            ids_all = self.send_to_holders(ids, n, "forward", "ids")
            offs_all = self.send_to_holders(offs, b + 1, "forward", "offsets") if offs is not None else None
            psw_all = self.send_to_holders(psw, n, "forward", "weights") if psw is not None else None
            mask = None
            if self.scheme == "row_wise":
                ids_all, mask = self.localize(ids_all, weight)
                if pooled_op:
                    psw_all = (
                        mask if psw_all is None else call(g, aten.mul.Tensor, mask, psw_all, phase="forward")
                    )
            if holder:
                parts = []
                for i in range(self.d):
                    ids_i = call(g, aten.slice.Tensor, ids_all, 0, i * n, (i + 1) * n, phase="forward")
                    if pooled_op:
                        offs_i = call(
                            g, aten.slice.Tensor, offs_all, 0, i * (b + 1), (i + 1) * (b + 1), phase="forward"
                        )
                        psw_i = None
                        if psw_all is not None:
                            psw_i = call(
                                g, aten.slice.Tensor, psw_all, 0, i * n, (i + 1) * n, phase="forward"
                            )
                        part_mode = 0 if self.scheme == "row_wise" else mode
                        part = call(g, lk.target, weight, ids_i, offs_i, psw_i, part_mode, phase="forward")
                    else:
                        part = call(g, lk.target, weight, ids_i, phase="forward")
                    part.meta[OVERRIDE_KEY] = lk.meta.get(OVERRIDE_KEY)
                    part.meta[SHARDING_KEY] = {**self.sh, "role": "lookup", "table": self.table}
                    if mask is not None and not pooled_op:  # rows held elsewhere contribute zeros
                        mask_i = call(g, aten.slice.Tensor, mask, 0, i * n, (i + 1) * n, phase="forward")
                        mask_i = call(g, aten.unsqueeze.default, mask_i, 1, phase="forward")
                        part = call(g, aten.mul.Tensor, part, mask_i, phase="forward")
                    parts.append(part)
                send = parts[0] if len(parts) == 1 else call(g, aten.cat.default, parts, 0, phase="forward")
            else:
                send = _zeros(g, [0, self.local_dim], weight, "forward")
            out_splits = [b if j in self.holders else 0 for j in range(self.d)]
            in_splits = [b if holder else 0] * self.d
            pooled = self.a2a(send, out_splits, in_splits, "forward", "pooled")
            pooled = self.combine(pooled, offs, b, mode)
        lk.replace_all_uses_with(pooled)
        g.erase_node(lk)
        self.rewrite_backward(ids, n, ids_all, mask, weight)

    def localize(self, ids_all: fx.Node, weight: fx.Node) -> tuple[fx.Node, fx.Node]:
        """Row-wise: ids relative to this device's row block (0 outside it) and a 0/1 mask of ids it holds."""
        g = self.graph
        lo = self.rank * self.local_rows
        local = call(g, aten.sub.Tensor, ids_all, lo, phase="forward")
        inside = call(
            g,
            aten.logical_and.default,
            call(g, aten.ge.Scalar, local, 0, phase="forward"),
            call(g, aten.lt.Scalar, local, self.local_rows, phase="forward"),
            phase="forward",
        )
        local = call(g, aten.where.ScalarOther, inside, local, 0, phase="forward")
        mask = call(g, aten._to_copy.default, inside, phase="forward")
        mask.update_kwarg("dtype", _dtype(weight))
        return local, mask

    def combine(self, recv: fx.Node, offs: fx.Node | None, b: int, mode: Any) -> fx.Node:
        g = self.graph
        if self.scheme == "table_wise":
            return recv
        if self.scheme == "column_wise":
            parts = call(g, aten.view.default, recv, [self.d, b, self.local_dim], phase="forward")
            perm = call(g, aten.permute.default, parts, [1, 0, 2], phase="forward")
            dense = _contiguous(g, perm, "forward")
            return call(g, aten.view.default, dense, [b, self.dim], phase="forward")
        total = call(
            g,
            aten.sum.dim_IntList,
            call(g, aten.view.default, recv, [self.d, b, self.dim], phase="forward"),
            [0],
            phase="forward",
        )
        if mode == 1 and offs is not None:
            hi = call(g, aten.slice.Tensor, offs, 0, 1, b + 1, phase="forward")
            lo = call(g, aten.slice.Tensor, offs, 0, 0, b, phase="forward")
            lengths = call(
                g, aten.clamp.default, call(g, aten.sub.Tensor, hi, lo, phase="forward"), 1, phase="forward"
            )
            lengths = call(g, aten.unsqueeze.default, lengths, 1, phase="forward")
            total = call(g, aten.div.Tensor, total, lengths, phase="forward")
        return total

    def rewrite_backward(
        self, ids: fx.Node, n: int, ids_all: fx.Node, mask: fx.Node | None, weight: fx.Node
    ) -> None:
        g = self.graph
        found = [
            u
            for u in ids.users
            if u.target == aten.index_add.default
            and len(u.args) >= 4
            and u.args[2] is ids
            and u.args[1] == 0
            and tuple(_shape(u)) == (self.rows, self.dim)
        ]
        if len(found) != 1 or found[0] in self.claimed:
            raise ConfigError(
                f"{self.name}: expected exactly one gradient `index_add(zeros[{self.rows}, {self.dim}], 0, ids, "
                f"per_id)` for the lookup %{self.lookup.name} of {self.table!r}, found {len(found)}"
                + (
                    f" (already used by {self.claimed.get(found[0])})"
                    if found and found[0] in self.claimed
                    else ""
                )
                + ". Fix: give each table its own ids tensor, or shard this table with FSDP instead."
            )
        grad = found[0]
        self.claimed[grad] = self.table
        per_id = grad.args[3]
        phase = grad.meta.get(PHASE_KEY, "backward")
        with g.inserting_before(grad.next):
            if self.scheme == "column_wise":
                v = call(g, aten.view.default, per_id, [n, self.d, self.local_dim], phase=phase)
                p = call(g, aten.permute.default, v, [1, 0, 2], phase=phase)
                payload = call(
                    g, aten.view.default, _contiguous(g, p, phase), [self.d * n, self.local_dim], phase=phase
                )
                recv = self.a2a(payload, [n] * self.d, [n] * self.d, phase, "grad")
            else:
                recv = self.send_to_holders(per_id, n, phase, "grad")
            if mask is not None:
                recv = call(
                    g,
                    aten.mul.Tensor,
                    recv,
                    call(g, aten.unsqueeze.default, mask, 1, phase=phase),
                    phase=phase,
                )
            # the data-parallel mean taken per id, before the rows accumulate: the gradient keeps the form
            # `zeros.index_add(0, ids, g)` that recir-embed-sparsify-update turns into row-wise updates (a
            # division after the sum left every sharded table a dense O(rows) update on the GPU path)
            recv = call(g, aten.div.Tensor, recv, self.d, phase=phase)
            zeros = _zeros(g, [self.local_rows, self.local_dim], weight, phase)
            local_grad = call(g, aten.index_add.default, zeros, 0, ids_all, recv, phase=phase)
            local_grad.meta[SHARDING_KEY] = {**self.sh, "role": "gradient", "table": self.table}
            if GRAD_OF_KEY in grad.meta:
                local_grad.meta[GRAD_OF_KEY] = grad.meta[GRAD_OF_KEY]
        grad.replace_all_uses_with(local_grad)


def _check_only_lookups(step: StepGraph, table: str, name: str) -> None:
    aliases = aliases_of(state_placeholders(step)[table])
    for user in (u for a in aliases for u in a.users):
        if user.op == "output" or user.meta.get(PHASE_KEY) == "optimizer" or user in aliases:
            continue
        if user.target in lookup_ops() and user.args[0] in aliases:
            continue
        raise ConfigError(
            f"{name}: table {table!r} is read by %{user.name} ({user.target}) outside its lookups; a sharded "
            "table may only be read by recir::embedding_bag (per-sample-weight gradients read the table). "
            "Fix: replicate this table (DataParallel) or shard it with FSDP."
        )


def _shape(node: Any) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _ndim(node: Any) -> int:
    return len(_shape(node))


def _contiguous(g: fx.Graph, x: fx.Node, phase: str) -> fx.Node:
    node = call(g, aten.clone.default, x, phase=phase)
    node.kwargs = {"memory_format": torch.contiguous_format}
    return node


def _zeros(g: fx.Graph, shape: list[int], like: fx.Node, phase: str) -> fx.Node:
    node = call(g, aten.zeros.default, shape, phase=phase)
    node.kwargs = {"dtype": _dtype(like), "device": like.meta["val"].device}
    return node


def _dtype(node: Any) -> torch.dtype:
    return node.meta["val"].dtype
