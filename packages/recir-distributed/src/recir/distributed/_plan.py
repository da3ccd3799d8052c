"""ShardingPlan: plain-data placements for every state and batch slot, printable and saved as JSON.

A slot's sharding is a dict such as ``{"placement": "shard", "axis": "data", "dim": 0, "num_shards": 2,
"scheme": "fsdp"}``; the same dict is written on graph nodes under ``recir.sharding``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from recir.transforms import ConfigError, StateSlot, parse_slot_name

from ._mesh import Mesh


def _itemsize(dtype_name: str) -> int:
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {dtype_name!r} in a sharding plan")
    return torch.empty((), dtype=dtype).element_size()


def local_shape(shape: Sequence[int], sharding: Mapping[str, Any], rank: int) -> tuple[int, ...]:
    """The shape device ``rank`` holds of a slot of global ``shape`` under ``sharding``."""
    shape = tuple(shape)
    if sharding.get("placement") != "shard":
        return shape
    dim, scheme = sharding["dim"], sharding.get("scheme")
    out = list(shape)
    if scheme == "table_wise":
        if rank != sharding["owner"]:
            out[dim] = 0
        return tuple(out)
    n = sharding["num_shards"]
    out[dim] = shape[dim] // n
    return tuple(out)


def shard_range(shape: Sequence[int], sharding: Mapping[str, Any], rank: int) -> tuple[int, int, int]:
    """``(dim, start, stop)``: the slice of the global slot that device ``rank`` holds."""
    if sharding.get("placement") != "shard":
        return 0, 0, shape[0] if shape else 0
    dim = sharding["dim"]
    if sharding.get("scheme") == "table_wise":
        return (dim, 0, shape[dim]) if rank == sharding["owner"] else (dim, 0, 0)
    size = shape[dim] // sharding["num_shards"]
    return dim, rank * size, (rank + 1) * size


@dataclass
class ShardingPlan:
    """Where every state and batch slot lives, for one mode on one mesh.

    ``slots`` maps state slot name -> sharding dict; ``batch`` maps batch slot name -> sharding dict;
    ``shapes``/``dtypes`` keep the global slot shapes; ``tables`` lists the embedding-table slots;
    ``explanation`` says why (auto mode). ``group_name`` is the process group the collectives use.
    """

    mesh: Mesh
    mode: str
    slots: dict[str, dict[str, Any]]
    batch: dict[str, dict[str, Any]]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    tables: list[str] = field(default_factory=list)
    explanation: list[str] = field(default_factory=list)
    group_name: str = "0"
    memory_budget: int | None = None

    # -- queries ----------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.mesh.size

    def sharding(self, slot: str) -> dict[str, Any]:
        try:
            return self.slots[slot]
        except KeyError:
            raise ConfigError(
                f"the plan has no state slot {slot!r}; it knows {len(self.slots)} slots"
            ) from None

    def local_shape(self, slot: str, rank: int) -> tuple[int, ...]:
        return local_shape(self.shapes[slot], self.sharding(slot), rank)

    def slot_bytes(self, slot: str, rank: int) -> int:
        return math.prod(self.local_shape(slot, rank)) * _itemsize(self.dtypes[slot])

    def bytes_per_device(self, kinds: Sequence[str] | None = None) -> list[int]:
        """Bytes of state each device holds (optionally only slots whose name starts with ``kinds``)."""
        out = []
        for rank in range(self.world_size):
            total = 0
            for slot in self.slots:
                if kinds is None or parse_slot_name(slot).kind in kinds:
                    total += self.slot_bytes(slot, rank)
            out.append(total)
        return out

    def local_slot(self, slot: StateSlot, rank: int) -> StateSlot:
        return StateSlot(slot.name, slot.kind, self.local_shape(slot.name, rank), slot.dtype)

    # -- printing ---------------------------------------------------------------------------------
    def format_table(self) -> str:
        """A table: slot, rows, dim, sharding, bytes per device (max over devices)."""
        rows = [("slot / table", "rows", "dim", "sharding", "bytes/device")]
        for name, sh in self.slots.items():
            shape = self.shapes[name]
            per = [self.slot_bytes(name, r) for r in range(self.world_size)]
            rows.append(
                (
                    name + (" [table]" if name in self.tables else ""),
                    str(shape[0]) if shape else "-",
                    str(math.prod(shape[1:])) if len(shape) > 1 else "-",
                    describe(sh),
                    _fmt_bytes(max(per)) + ("" if len(set(per)) == 1 else f" (min {_fmt_bytes(min(per))})"),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [
            "  ".join(c.ljust(w) if i in (0, 3) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        totals = self.bytes_per_device()
        lines.append("total per device: " + ", ".join(f"{r}: {_fmt_bytes(b)}" for r, b in enumerate(totals)))
        if self.memory_budget is not None:
            lines.append(f"memory budget per device: {_fmt_bytes(self.memory_budget)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        head = f"ShardingPlan(mode={self.mode}, mesh={self.mesh.axes}, group={self.group_name!r})"
        batch = ", ".join(f"{k}: {describe(v)}" for k, v in self.batch.items())
        parts = [head, self.format_table(), f"batch: {batch}"]
        if self.explanation:
            parts.append("why:\n" + "\n".join(f"  - {e}" for e in self.explanation))
        return "\n".join(parts)

    def __repr__(self) -> str:
        return f"ShardingPlan({self.mode}, mesh={self.mesh.axes})"

    # -- JSON -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh.to_dict(),
            "mode": self.mode,
            "slots": self.slots,
            "batch": self.batch,
            "shapes": {k: list(v) for k, v in self.shapes.items()},
            "dtypes": self.dtypes,
            "tables": self.tables,
            "explanation": self.explanation,
            "group_name": self.group_name,
            "memory_budget": self.memory_budget,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardingPlan:
        return cls(
            mesh=Mesh.from_dict(data["mesh"]),
            mode=data["mode"],
            slots={k: dict(v) for k, v in data["slots"].items()},
            batch={k: dict(v) for k, v in data["batch"].items()},
            shapes={k: tuple(v) for k, v in data["shapes"].items()},
            dtypes=dict(data["dtypes"]),
            tables=list(data.get("tables", [])),
            explanation=list(data.get("explanation", [])),
            group_name=data.get("group_name", "0"),
            memory_budget=data.get("memory_budget"),
        )

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON, atomically (a reader sees the old file or the new one)."""
        from ._checkpoint_manager import write_atomically

        write_atomically(path, json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ShardingPlan:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardingPlan) and self.to_dict() == other.to_dict()


def as_plan(plan: object, where: str) -> ShardingPlan | None:
    """``plan`` as a ShardingPlan (or None); anything else is a ConfigError naming ``where`` and the fix."""
    if plan is None or isinstance(plan, ShardingPlan):
        return plan
    raise ConfigError(
        f"{where}: plan must be a recir.distributed.ShardingPlan, got {type(plan).__name__}. "
        "Fix: plan = recir.distributed.plan(step, mode, mesh), or ShardingPlan.load(path)."
    )


def describe(sh: Mapping[str, Any]) -> str:
    """``replicate``, ``shard(dim=0, data, 2 ways, fsdp)``, ``table_wise(owner=1)``."""
    if sh.get("placement") != "shard":
        grad = sh.get("grad")
        return "replicate" + (f", grad {grad}" if grad else "")
    scheme = sh.get("scheme", "shard")
    if scheme == "table_wise":
        return f"table_wise(owner={sh['owner']}, {sh['axis']})"
    return f"{scheme}(dim={sh['dim']}, {sh['axis']} x{sh['num_shards']})"


def _fmt_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024  # type: ignore[assignment]
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n:.1f} PiB"
