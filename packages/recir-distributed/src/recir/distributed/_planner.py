"""``plan(step, mode, mesh)``: decide a placement for every slot, check it fits, annotate the graph.

``mode="auto"`` places tables by size against a per-device memory budget and records why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
from recir.transforms import SHARDING_KEY, ConfigError, StepGraph, slot_path

from ._graphinfo import (
    batch_placeholders,
    grad_nodes,
    lookups_of,
    optim_slots_of,
    state_placeholders,
    table_slots,
)
from ._mesh import Mesh
from ._modes import (
    DataParallel,
    EmbeddingSharding,
    FullyShardedDataParallel,
    HybridParallel,
    Mode,
    mode_name,
    normalize_mode,
)
from ._plan import ShardingPlan, _fmt_bytes
from ._traffic import format_traffic, table_traffic

REPLICATE: dict[str, Any] = {"placement": "replicate"}


def plan(
    step: StepGraph,
    mode: Mode,
    mesh: Mesh,
    *,
    memory_budget: int | None = None,
    batch: Literal["local", "global"] = "local",
    group_name: str | None = None,
) -> ShardingPlan:
    """Place every state slot and batch slot of ``step`` for ``mode`` on ``mesh``; annotate the graph.

    ``batch="local"``: the step was captured with one device's batch (GPU path, one process per device);
    ``"global"``: with the whole batch (TPU path, GSPMD splits it), whose size must divide by the data axis.
    ``memory_budget`` (bytes of state per device) is checked for every mode and drives ``mode="auto"``.
    """
    mesh.validate()
    resolved = normalize_mode(mode)
    sig = step.signature
    tables = table_slots(step)
    shapes = {s.name: tuple(s.shape) for s in sig.state}
    dtypes = {s.name: str(s.dtype).removeprefix("torch.") for s in sig.state}
    slots: dict[str, dict[str, Any]] = {s.name: dict(REPLICATE) for s in sig.state}
    explanation: list[str] = []
    table_axis = "model" if mesh.model_size > 1 else "data"
    nshards = mesh.axis_size(table_axis)

    def assign(param: str, sh: dict[str, Any]) -> None:
        slots[param] = sh
        for o in optim_slots_of(step, param):
            slots[o.name] = _follow(param, shapes[param], o.name, o.shape, sh)

    def fsdp(opts: FullyShardedDataParallel, skip: set[str]) -> None:
        d = mesh.data_size
        for s in sig.state:
            if s.kind != "param" or not s.shape or s.name in skip:
                continue
            if s.shape[0] % d or math.prod(s.shape) < opts.min_numel:
                explanation.append(f"{s.name}: replicated (dim 0 = {s.shape[0]} does not split {d} ways)")
                continue
            assign(
                s.name, {"placement": "shard", "axis": "data", "dim": 0, "num_shards": d, "scheme": "fsdp"}
            )

    if isinstance(resolved, FullyShardedDataParallel):
        fsdp(resolved, set())
    elif isinstance(resolved, HybridParallel):
        _place_tables(resolved, tables, shapes, dtypes, nshards, table_axis, assign, explanation)
        if isinstance(resolved.dense, FullyShardedDataParallel):
            fsdp(resolved.dense, {t for t in tables if slots[t].get("placement") == "shard"})
    elif resolved == "auto":
        _auto(step, tables, shapes, dtypes, nshards, table_axis, memory_budget, assign, explanation)
    elif not isinstance(resolved, DataParallel):  # pragma: no cover - normalize_mode guards this
        raise ConfigError(f"unsupported mode {resolved!r}")

    grads = grad_nodes(step)
    for name, sh in slots.items():
        if name in grads:
            sh["grad"] = _grad_collective(sh)

    batch_plan = _plan_batch(step, mesh, batch)
    if tables and nshards > 1:  # what each placement of each table would cost in traffic, the choice marked
        chosen = {t: str(slots[t].get("scheme", "replicate")) for t in tables}
        explanation.extend(
            format_traffic(table_traffic(step, mesh, batch=batch, axis=table_axis), chosen).split("\n")
        )
    if group_name is None:
        group_name = _default_group_name()
    result = ShardingPlan(
        mesh=mesh,
        mode=mode_name(resolved),
        slots=slots,
        batch=batch_plan,
        shapes=shapes,
        dtypes=dtypes,
        tables=tables,
        explanation=explanation,
        group_name=group_name,
        memory_budget=memory_budget,
    )
    if memory_budget is not None:
        check_budget(result, memory_budget)
    annotate(step, result)
    return result


def annotate(step: StepGraph, plan: ShardingPlan) -> StepGraph:
    """Write ``recir.sharding`` on the slot placeholders, gradient nodes and table lookups of ``step``."""
    for name, node in state_placeholders(step).items():
        if name in plan.slots:
            node.meta[SHARDING_KEY] = dict(plan.slots[name])
    for name, node in batch_placeholders(step).items():
        if name in plan.batch:
            node.meta[SHARDING_KEY] = dict(plan.batch[name])
    for name, node in grad_nodes(step).items():
        if name in plan.slots:
            node.meta[SHARDING_KEY] = {**plan.slots[name], "role": "gradient"}
    for table in plan.tables:
        for user in lookups_of(step, table):
            user.meta[SHARDING_KEY] = {**plan.slots[table], "role": "lookup", "table": table}
    return step


def check_budget(plan: ShardingPlan, budget: int) -> None:
    """Raise ConfigError naming the largest slot on any device whose state exceeds ``budget`` bytes."""
    for rank, total in enumerate(plan.bytes_per_device()):
        if total > budget:
            biggest = max(plan.slots, key=lambda s: plan.slot_bytes(s, rank))
            raise ConfigError(
                f"the plan ({plan.mode}) does not fit: device {rank} holds {_fmt_bytes(total)} ({total} bytes) "
                f"of state, the memory budget is {_fmt_bytes(budget)} ({budget} bytes); its largest slot is "
                f"{biggest!r} with {plan.slot_bytes(biggest, rank)} bytes. Fix: shard that table "
                "(row_wise/column_wise), use mode='auto', add devices, or raise memory_budget."
            )


# -- helpers -------------------------------------------------------------------------------------------
def _follow(
    param: str, pshape: tuple[int, ...], name: str, oshape: tuple[int, ...], sh: dict[str, Any]
) -> dict[str, Any]:
    """The sharding of an optimizer slot that belongs to ``param`` (same shape, or one value per row)."""
    if tuple(oshape) == tuple(pshape):
        return dict(sh)
    if len(oshape) == 1 and pshape and oshape[0] == pshape[0] and sh["dim"] == 0:
        return dict(sh)  # row-wise optimizer state (RowWiseAdagrad): one value per row
    if math.prod(oshape) <= 1:
        return dict(REPLICATE)
    raise ConfigError(
        f"optimizer slot {name!r} {list(oshape)} cannot follow {param!r} {list(pshape)} sharded as "
        f"{sh.get('scheme')} on dim {sh['dim']}. Fix: shard this table row-wise/table-wise or replicate it."
    )


def _grad_collective(sh: dict[str, Any]) -> str:
    if sh.get("placement") != "shard":
        return "all_reduce"
    return "reduce_scatter" if sh.get("scheme") == "fsdp" else "all_to_all"


def _table_sharding(
    scheme: str, shape: tuple[int, ...], n: int, axis: str, owner: int, name: str
) -> dict[str, Any]:
    if scheme == "table_wise":
        return {
            "placement": "shard",
            "axis": axis,
            "dim": 0,
            "num_shards": 1,
            "scheme": "table_wise",
            "owner": owner,
        }
    dim = 0 if scheme == "row_wise" else 1
    if shape[dim] % n:
        raise ConfigError(
            f"table {name!r} {list(shape)}: {scheme} needs dim {dim} ({shape[dim]}) divisible by the "
            f"{n} devices of mesh axis {axis!r}. Fix: pad the table to {math.ceil(shape[dim] / n) * n}, "
            "or use another scheme (table_wise)."
        )
    return {"placement": "shard", "axis": axis, "dim": dim, "num_shards": n, "scheme": scheme}


def _table_bytes(
    table: str, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str], step_optims: list[str]
) -> int:
    total = 0
    for name in (table, *step_optims):
        item = torch.empty((), dtype=getattr(torch, dtypes[name])).element_size()
        total += math.prod(shapes[name]) * item
    return total


def _place_tables(mode, tables, shapes, dtypes, n, axis, assign, explanation) -> None:  # noqa: ANN001
    load = [0] * n
    for table in sorted(tables, key=lambda t: -math.prod(shapes[t])):
        sharding: EmbeddingSharding | None = next(
            (s for s in mode.table_shardings() if s.covers(table)), None
        )
        if sharding is None:
            explanation.append(f"{table}: replicated (no table sharding covers it)")
            continue
        owner = sharding.owners.get(table, sharding.owners.get(str(slot_path(table)), -1))
        if sharding.scheme == "table_wise" and owner < 0:
            owner = min(range(n), key=lambda r: load[r])
        if sharding.scheme == "table_wise":
            if not 0 <= owner < n:
                raise ConfigError(
                    f"table {table!r}: owner {owner} is outside the {n} devices of axis {axis!r}"
                )
            load[owner] += math.prod(shapes[table])
        assign(table, _table_sharding(sharding.scheme, shapes[table], n, axis, owner, table))


def _auto(step, tables, shapes, dtypes, n, axis, budget, assign, explanation) -> None:  # noqa: ANN001
    """Greedy by size: a whole table on the least-loaded device if it fits, else row-wise, else fail."""
    dense = sum(
        _table_bytes(s.name, shapes, dtypes, [])
        for s in step.signature.state
        if s.name not in tables
        and not any(s.kind == "optim" and slot_path(s.name) == slot_path(t) for t in tables)
    )
    load = [dense] * n
    limit = budget if budget is not None else math.inf
    explanation.append(
        f"dense state is replicated: {_fmt_bytes(dense)} per device; budget "
        + (f"{_fmt_bytes(budget)} per device" if budget is not None else "unlimited")
    )
    sizes = {t: _table_bytes(t, shapes, dtypes, [o.name for o in optim_slots_of(step, t)]) for t in tables}
    for table in sorted(tables, key=lambda t: -sizes[t]):
        size, rows = sizes[table], shapes[table][0]
        r = min(range(n), key=lambda i: load[i])
        if load[r] + size <= limit:
            load[r] += size
            assign(table, _table_sharding("table_wise", shapes[table], n, axis, r, table))
            explanation.append(
                f"{table}: table_wise on device {r} ({_fmt_bytes(size)} fits; device {r} now holds {_fmt_bytes(load[r])})"
            )
            continue
        per = math.ceil(size / n)
        if rows % n == 0 and max(load) + per <= limit:
            load = [x + per for x in load]
            assign(table, _table_sharding("row_wise", shapes[table], n, axis, 0, table))
            explanation.append(
                f"{table}: row_wise over {n} devices ({_fmt_bytes(size)} whole does not fit next to "
                f"{_fmt_bytes(load[r] - per)}; {_fmt_bytes(per)} per device does)"
            )
            continue
        raise ConfigError(
            f"table {table!r} ({shapes[table][0]} x {math.prod(shapes[table][1:])}, {size} bytes with optimizer "
            f"state) does not fit the memory budget of {budget} bytes per device: whole it needs {size} bytes "
            f"next to the {load[r]} bytes on the least-loaded device {r}; row-wise over {n} devices it needs "
            f"{per} bytes per device next to up to {max(load)} bytes"
            + ("" if rows % n == 0 else f" (and its {rows} rows do not split {n} ways)")
            + ". Fix: raise memory_budget, add devices, or shrink the table."
        )


def _plan_batch(step: StepGraph, mesh: Mesh, batch: str) -> dict[str, dict[str, Any]]:
    d = mesh.data_size
    out: dict[str, dict[str, Any]] = {}
    for slot in step.signature.batch:
        if not slot.shape:
            out[slot.name] = dict(REPLICATE)
            continue
        if batch == "global" and slot.role in ("dense", "label", "weight") and slot.shape[0] % d:
            raise ConfigError(
                f"batch slot {slot.name!r} has {slot.shape[0]} samples, not divisible by the data-parallel "
                f"size {d} (mesh axis 'data'). Fix: use a global batch that is a multiple of {d} "
                f"(e.g. {slot.shape[0] // d * d or d} or {(slot.shape[0] // d + 1) * d})."
            )
        out[slot.name] = {"placement": "shard", "axis": "data", "dim": 0, "num_shards": d, "role": slot.role}
    return out


def _default_group_name() -> str:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD.group_name
    return "0"
