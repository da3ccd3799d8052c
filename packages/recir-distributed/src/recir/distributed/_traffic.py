"""Communication bytes per step of each way to place an embedding table (what ``plan`` prints for every
table and every choice, so a user sees what a placement costs besides memory).

A model, not a measurement: it counts what one device sends per training step (forward and backward)
for a table's lookups, from the lookups' shapes in the graph. ``communication_bytes(distribute(...))``
measures the GPU path's per-device program instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from recir.transforms import StepGraph

from ._graphinfo import lookups_of, table_slots
from ._mesh import Mesh

SCHEMES = ("table_wise", "row_wise", "column_wise", "ring_shift")


@dataclass(frozen=True)
class TableTraffic:
    """One table's lookups as a device sees them per step, and the bytes each choice sends.

    ``ids``/``rows_out``: ids looked up and rows produced (pooled bags, or one per id) per device;
    ``dim``, ``row_bytes`` = ``dim * itemsize``; ``shards``: devices the table would split over.
    """

    table: str
    ids: int
    rows_out: int
    dim: int
    row_bytes: int
    id_bytes: int
    shards: int

    def bytes_sent(self, scheme: str) -> int:
        """Bytes the busiest device sends per step (forward + backward) if the table is placed by ``scheme``.

        - ``table_wise``: ids go to the owner, pooled rows come back, their gradients go to the owner;
          the owner sends rows to the other ``n-1`` devices: ``max((n-1) B R, N i + B R)``.
        - ``row_wise``: ids to every other device, partial rows back, gradients to every holder:
          ``(n-1) (N i + 2 B R)``.
        - ``column_wise``: the same with column blocks: ``(n-1) (N i + 2 B R / n)``.
        - ``ring_shift``: row-wise storage; forward, ids and partial (unpooled) rows travel ``n`` hops:
          ``n N (i + R)``; backward as ``row_wise`` (row gradients to every holder): ``(n-1) B R``.
        (``N`` ids, ``B`` rows out, ``R`` bytes per row, ``i`` bytes per id, ``n`` shards.)
        """
        n, ids, rows, row, idb = self.shards, self.ids, self.rows_out, self.row_bytes, self.id_bytes
        if n <= 1:
            return 0
        if scheme == "table_wise":
            return max((n - 1) * rows * row, ids * idb + rows * row)
        if scheme == "row_wise":
            return (n - 1) * (ids * idb + 2 * rows * row)
        if scheme == "column_wise":
            return (n - 1) * (ids * idb + 2 * rows * row // n)
        if scheme == "ring_shift":
            return n * ids * (idb + row) + (n - 1) * rows * row
        raise ValueError(f"unknown table placement {scheme!r}; expected one of {SCHEMES}")


def table_traffic(
    step: StepGraph, mesh: Mesh, *, batch: Literal["local", "global"] = "local", axis: str | None = None
) -> dict[str, TableTraffic]:
    """Table slot -> its lookups' traffic on ``mesh`` (tables split over ``axis``, default ``model`` if
    the mesh has more than one model device, else ``data``). ``batch="global"``: the step was captured
    with the whole batch, which the data axis splits."""
    axis = axis or ("model" if mesh.model_size > 1 else "data")
    per_device = mesh.data_size if batch == "global" else 1
    sizes = {s.name: s for s in step.signature.state}
    out: dict[str, TableTraffic] = {}
    for table in table_slots(step):
        ids = rows = id_bytes = 0
        for node in lookups_of(step, table):
            indices = node.args[1].meta["val"]  # type: ignore[union-attr]
            ids += indices.numel()
            id_bytes = max(id_bytes, indices.element_size())
            bag = len(node.args) > 2 and getattr(node.args[2], "meta", {}).get("val") is not None
            rows += node.args[2].meta["val"].numel() - 1 if bag else indices.numel()  # type: ignore[union-attr]
        slot = sizes[table]
        dim = math.prod(slot.shape[1:])
        out[table] = TableTraffic(
            table=table,
            ids=math.ceil(ids / per_device),
            rows_out=math.ceil(rows / per_device),
            dim=dim,
            row_bytes=dim * torch.empty((), dtype=slot.dtype).element_size(),
            id_bytes=id_bytes,
            shards=mesh.axis_size(axis),
        )
    return out


def format_traffic(traffic: Mapping[str, TableTraffic], chosen: Mapping[str, str] | None = None) -> str:
    """One line per table: the bytes one device sends per step under each placement (``*`` = chosen)."""
    from ._plan import _fmt_bytes

    chosen = chosen or {}
    lines = []
    for table, t in traffic.items():
        costs = ", ".join(
            f"{s} {_fmt_bytes(t.bytes_sent(s))}{'*' if chosen.get(table) == s else ''}" for s in SCHEMES
        )
        lines.append(f"{table}: communication per step per device: {costs}")
    return "\n".join(lines)
