"""The hook between recir.distributed and this lowering: a StepGraph given with a ShardingPlan is first
turned into this rank's program (collectives as graph nodes) unless it already is one.
"""

from __future__ import annotations

from typing import Any

from recir.transforms import ConfigError, StepGraph


def distribute_for_lowering(step: StepGraph, plan: Any) -> StepGraph:
    """``step`` as this process's per-device program under ``plan`` (a recir.distributed ShardingPlan)."""
    from recir.distributed import DISTRIBUTED_META, ShardingPlan, distribute

    if plan is None or DISTRIBUTED_META in step.meta:
        return step
    if not isinstance(plan, ShardingPlan):
        raise ConfigError(
            f"recir.lower_gpu.compile: plan must be a recir.distributed.ShardingPlan, got {type(plan).__name__}. "
            "Fix: plan = recir.distributed.plan(step, mode, mesh)."
        )
    return distribute(step, plan)
