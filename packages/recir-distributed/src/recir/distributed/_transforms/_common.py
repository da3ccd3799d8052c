"""Options and checks shared by the collective-inserting transforms."""

from __future__ import annotations

from dataclasses import dataclass

from recir.transforms import ConfigError, StepGraph

from .._plan import ShardingPlan


@dataclass(frozen=True, eq=False)
class PlanOptions:
    """The plan to realise and the device (rank) whose program is being built."""

    plan: ShardingPlan
    rank: int = 0


def check_plan_matches(step: StepGraph, plan: ShardingPlan, rank: int, name: str) -> None:
    if not 0 <= rank < plan.world_size:
        raise ConfigError(f"{name}: rank {rank} is outside the plan's {plan.world_size} devices")
    missing = [s.name for s in step.signature.state if s.name not in plan.slots]
    if missing:
        raise ConfigError(
            f"{name}: the plan has no placement for state slots {missing[:4]}; it was made for another "
            "step. Fix: call recir.distributed.plan(step, mode, mesh) on this step."
        )
    active = [a for a, n in plan.mesh.axes.items() if n > 1]
    if len(active) > 1:
        raise ConfigError(
            f"{name}: the GPU path supports one active mesh axis, the plan's mesh is {plan.mesh.axes}. "
            "Fix: use a 1-D mesh such as Mesh(axes={'data': N}) here; 2-D meshes run on the TPU path (GSPMD)."
        )
