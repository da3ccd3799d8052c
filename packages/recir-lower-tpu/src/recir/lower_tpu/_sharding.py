"""A recir.distributed ShardingPlan as JAX shardings: NamedShardings for state and batch slots, so GSPMD
partitions the global step (the TPU path captures the whole batch; the plan says how to split it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import torch.fx as fx
from jax.sharding import AxisType, NamedSharding, PartitionSpec, Sharding
from recir.distributed import ShardingPlan
from recir.transforms import SHARDING_KEY, BatchSlot, ConfigError, StateSlot

from ._placement import Placement


def partition_spec(
    sharding: Mapping[str, Any], shape: tuple[int, ...], mesh_axes: Mapping[str, int]
) -> PartitionSpec:
    """The PartitionSpec of one slot's ``recir.sharding`` dict.

    ``fsdp``/``row_wise``/batch shards map to ``P(axis)`` on their dim, ``column_wise`` to ``P(None, axis)``;
    replicated slots and ``table_wise`` tables (one device holds a whole table: no GSPMD layout) to ``P()``.
    A dim that does not divide by its axis is replicated (GSPMD would otherwise pad it).
    """
    if sharding.get("placement") != "shard" or sharding.get("scheme") == "table_wise":
        return PartitionSpec()
    axis, dim = sharding.get("axis", "data"), int(sharding.get("dim", 0))
    size = mesh_axes.get(axis, 1)
    if axis not in mesh_axes or dim >= len(shape) or size == 1 or shape[dim] % size:
        return PartitionSpec()
    return PartitionSpec(*([None] * dim), axis)


class PlannedPlacement(Placement):
    """Placement whose state and batch shardings follow a ShardingPlan (``plan.slots`` / ``plan.batch``)."""

    def __init__(self, mesh: Any, plan: ShardingPlan) -> None:
        super().__init__(plan.mesh if mesh is None else mesh, plan)
        self.plan: ShardingPlan = plan
        assert self.mesh is not None
        # GSPMD partitions freely only over Auto axes (Explicit axes make every op state its sharding).
        names = tuple(self.mesh.axis_names)
        self.mesh = jax.sharding.Mesh(self.mesh.devices, names, axis_types=(AxisType.Auto,) * len(names))
        self._axes = dict(self.mesh.shape)
        plan_axes = dict(plan.mesh.axes)
        if plan_axes != self._axes:
            raise ConfigError(
                f"recir.lower_tpu: the plan was made for mesh {plan_axes}, compile got {self._axes}. "
                "Fix: pass mesh=plan.mesh (or plan again for this mesh)."
            )

    def state_sharding(self, slot: StateSlot) -> Sharding:
        sh = self.plan.slots.get(slot.name, {})
        return NamedSharding(self.mesh, partition_spec(sh, tuple(slot.shape), self._axes))

    def batch_sharding(self, slot: BatchSlot) -> Sharding:
        sh = self.plan.batch.get(slot.name, {})
        return NamedSharding(self.mesh, partition_spec(sh, tuple(slot.shape), self._axes))

    def node_sharding(self, node: fx.Node) -> NamedSharding | None:
        """The sharding constraint for an annotated node's value, or None to leave it to GSPMD.

        Gradient nodes carry their parameter's placement (``recir.sharding`` with ``role: gradient``):
        constraining them makes GSPMD reduce-scatter a sharded parameter's gradient instead of
        all-reducing it and slicing afterwards. Lookups (``role: lookup``) describe the table, not the
        looked-up rows, so they get no constraint.
        """
        sh = node.meta.get(SHARDING_KEY)
        val = node.meta.get("val")
        if not isinstance(sh, Mapping) or sh.get("role") != "gradient" or not hasattr(val, "shape"):
            return None
        spec = partition_spec(sh, tuple(val.shape), self._axes)
        return NamedSharding(self.mesh, spec) if spec != PartitionSpec() else None

    def describe(self) -> str:
        return f"mesh {self._axes} over {len(self.devices)} devices, sharded by plan {self.plan.mode}"


def placement_for(mesh: Any, plan: ShardingPlan | None) -> Placement:
    """The hook for ``compile``: a plan-driven placement when a ShardingPlan is given, else the default."""
    if plan is None:
        return Placement(mesh)
    return PlannedPlacement(mesh, plan)
