"""Parallel modes: what a plan should do with dense parameters and with embedding tables.

Modes are small frozen records; :func:`recir.distributed.plan` turns one into a ``ShardingPlan``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from recir.transforms import ConfigError, parse_slot_name

Scheme = Literal["table_wise", "row_wise", "column_wise"]
SCHEMES: tuple[str, ...] = ("table_wise", "row_wise", "column_wise")


@dataclass(frozen=True)
class DataParallel:
    """Replicate every parameter and optimizer state; average gradients with an all-reduce."""


@dataclass(frozen=True)
class FullyShardedDataParallel:
    """Shard parameters and their optimizer state along dim 0 over the data axis; gather for compute.

    A parameter whose dim 0 does not divide by the data-axis size (or with fewer than ``min_numel``
    elements) stays replicated and is averaged with an all-reduce, like DataParallel.
    """

    min_numel: int = 0


@dataclass(frozen=True)
class EmbeddingSharding:
    """Shard embedding tables: ``table_wise`` (whole tables on one device each), ``row_wise``
    (contiguous row blocks over all devices) or ``column_wise`` (column blocks over all devices).

    ``tables`` restricts it to some tables (by slot ``param:<path>`` or by ``<path>``); ``owners`` pins
    table-wise tables to devices (otherwise they are balanced by size).
    """

    scheme: Scheme
    tables: tuple[str, ...] | None = None
    owners: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ConfigError(f"embedding sharding scheme {self.scheme!r} is not one of {SCHEMES}")

    def covers(self, slot: str) -> bool:
        if self.tables is None:
            return True
        name = parse_slot_name(slot)
        return slot in self.tables or (name.kind == "param" and name.path in self.tables)


def table_wise(*tables: str, owners: Mapping[str, int] | None = None) -> EmbeddingSharding:
    """Each table lives whole on one device (``owners`` pins some; the rest are balanced by bytes)."""
    return EmbeddingSharding("table_wise", tuple(tables) or None, dict(owners or {}))


def row_wise(*tables: str) -> EmbeddingSharding:
    """Each table is split into equal contiguous row blocks, one per device."""
    return EmbeddingSharding("row_wise", tuple(tables) or None)


def column_wise(*tables: str) -> EmbeddingSharding:
    """Each table is split into equal column blocks, one per device (the dim must divide evenly)."""
    return EmbeddingSharding("column_wise", tuple(tables) or None)


@dataclass(frozen=True)
class HybridParallel:
    """Dense parameters data-parallel (or FSDP), embedding tables sharded (table-wise by default).

    ``tables`` is one EmbeddingSharding or several (the first that covers a table wins).
    """

    tables: EmbeddingSharding | tuple[EmbeddingSharding, ...] = field(default_factory=table_wise)
    dense: DataParallel | FullyShardedDataParallel = field(default_factory=DataParallel)

    def table_shardings(self) -> tuple[EmbeddingSharding, ...]:
        return self.tables if isinstance(self.tables, tuple) else (self.tables,)


Mode = DataParallel | FullyShardedDataParallel | EmbeddingSharding | HybridParallel | str


def normalize_mode(mode: Mode) -> DataParallel | FullyShardedDataParallel | HybridParallel | str:
    """EmbeddingSharding alone means HybridParallel with data-parallel dense parameters."""
    if isinstance(mode, EmbeddingSharding):
        return HybridParallel(tables=mode)
    if isinstance(mode, str):
        aliases = {"dp": "data_parallel", "ddp": "data_parallel", "fsdp": "fsdp", "auto": "auto"}
        key = aliases.get(mode.lower(), mode.lower())
        if key == "data_parallel":
            return DataParallel()
        if key == "fsdp":
            return FullyShardedDataParallel()
        if key in SCHEMES:
            return HybridParallel(tables=EmbeddingSharding(key))  # type: ignore[arg-type]
        if key == "auto":
            return "auto"
        raise ConfigError(
            f"unknown parallel mode {mode!r}; expected a mode object or one of "
            "'data_parallel', 'fsdp', 'table_wise', 'row_wise', 'column_wise', 'auto'"
        )
    if isinstance(mode, (DataParallel, FullyShardedDataParallel, HybridParallel)):
        return mode
    raise ConfigError(f"unknown parallel mode {mode!r} ({type(mode).__name__})")


def mode_name(mode: object) -> str:
    if isinstance(mode, str):
        return mode
    if isinstance(mode, HybridParallel):
        schemes = "+".join(s.scheme for s in mode.table_shardings())
        return f"hybrid({type(mode.dense).__name__}, {schemes})"
    return type(mode).__name__


PARALLEL_MODES: tuple[str, ...] = ("dp", "fsdp", "hybrid", "auto")
TABLE_SHARDINGS: tuple[str, ...] = ("row", "table", "column", "auto")


def parallel_mode(name: str, tables: str | None = None) -> Mode:
    """The mode named by a launcher's flags: ``name`` one of :data:`PARALLEL_MODES`, ``tables`` one of
    :data:`TABLE_SHARDINGS` or None.

    Without ``tables``: ``dp``, ``fsdp``, ``hybrid`` (data-parallel dense, table-wise tables) or
    ``auto`` (the planner places every table by memory budget). With ``tables`` ``row``, ``table`` or
    ``column``, the tables are sharded that way next to data-parallel dense state (FSDP for ``fsdp``);
    ``auto`` is the planner's placement with dense state replicated.

    >>> parallel_mode("fsdp", "row")
    HybridParallel(tables=EmbeddingSharding(scheme='row_wise', tables=None, owners={}), dense=FullyShardedDataParallel(min_numel=0))
    """
    if name not in PARALLEL_MODES:
        raise ConfigError(f"unknown parallel mode {name!r}; expected one of {', '.join(PARALLEL_MODES)}")
    if tables is None:
        by_name: dict[str, Mode] = {
            "dp": DataParallel(),
            "fsdp": FullyShardedDataParallel(),
            "hybrid": HybridParallel(tables=table_wise()),
            "auto": "auto",
        }
        return by_name[name]
    if tables not in TABLE_SHARDINGS:
        raise ConfigError(f"unknown table sharding {tables!r}; expected one of {', '.join(TABLE_SHARDINGS)}")
    if tables == "auto" or name == "auto":
        if name not in ("dp", "hybrid", "auto") or tables != "auto":
            raise ConfigError(
                f"parallel mode {name!r} with table sharding {tables!r}: the automatic placement keeps "
                "dense state replicated and chooses each table's placement itself. Fix: table sharding "
                "'auto' (with mode dp, hybrid or auto), or a fixed table sharding row, table or column."
            )
        return "auto"
    sharding = {"row": row_wise, "table": table_wise, "column": column_wise}[tables]()
    dense = FullyShardedDataParallel() if name == "fsdp" else DataParallel()
    return HybridParallel(tables=sharding, dense=dense)
