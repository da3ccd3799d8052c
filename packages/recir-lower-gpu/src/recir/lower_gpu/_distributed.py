"""The hook between recir.distributed and this lowering: a StepGraph given with a ShardingPlan is first
turned into this rank's program (collectives as graph nodes) unless it already is one.
"""

from __future__ import annotations

from recir.distributed import DISTRIBUTED_META, ShardingPlan, distribute
from recir.transforms import StepGraph


def distribute_for_lowering(step: StepGraph, plan: ShardingPlan | None) -> StepGraph:
    """``step`` as this process's per-device program under ``plan`` (a recir.distributed ShardingPlan)."""
    if plan is None or DISTRIBUTED_META in step.meta:
        return step
    return distribute(step, plan)
