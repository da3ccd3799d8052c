"""`--parallel` / `--mesh` / `--table_sharding`: the flags as recir.distributed plans and this rank's
slice of each global batch. Process and mesh setup live in recir.distributed, compile coordination across
ranks in recir.lower_gpu; CompiledTrainer composes them.
"""

from __future__ import annotations

from typing import Any, Literal

import recir.distributed as rd
from recir.transforms import ConfigError

from ._batch import Batch
from ._data import Data

DEFAULT_MESH_AXIS = "data"


def plan_step(
    graph: Any,
    mesh: Any,
    parallel: str,
    table_sharding: str | None,
    hbm_budget_gib: float | None,
    batch: Literal["local", "global"],
) -> Any:
    """The recir.distributed plan of a captured step for these flags (`--hbm_budget_gib`: per device)."""
    budget = None if hbm_budget_gib is None else int(hbm_budget_gib * 2**30)
    mode = rd.parallel_mode(parallel, table_sharding)
    return rd.plan(graph, mode, mesh, memory_budget=budget, batch=batch)


def describe_plan(plan: Any) -> list[str]:
    """Log lines: the tables' placements and the planner's reasons (traffic of each choice included)."""
    placed = ", ".join(f"{t} {plan.slots[t].get('scheme', 'replicated')}" for t in plan.tables)
    lines = [f"plan {plan.mode}: tables {placed or 'none'}"]
    return lines + [f"plan: {e}" for e in plan.explanation]


def check_batch_split(batch_size: int, data_size: int) -> None:
    if batch_size % data_size:
        lo = batch_size // data_size * data_size or data_size
        raise ConfigError(
            f"--batch_size {batch_size} (the global batch) does not split over the data-parallel size "
            f"{data_size}. Fix: use a multiple of {data_size}, e.g. --batch_size {lo} or "
            f"--batch_size {lo + data_size}."
        )


def local_batch(data: Data, step: int, rank: int, world: int) -> Batch:
    """Rank `rank`'s contiguous slice of global train step `step`'s samples (the global batch split),
    its loss normalised by the global batch's candidate count (`Batch.loss_norm`)."""
    return data.collate_slice([data.train[i] for i in data.train_indices(step)], rank, world)
