"""What the collective-inserting transforms share: their options, the plan check, and the skeleton
(check the plan, find the targets, rewrite a private copy of the step).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from recir.transforms import ConfigError, StepGraph, Transform, TransformResult

from .._graphinfo import require_grads
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


class PlanTransform(Transform):
    """A transform that realises part of a :class:`ShardingPlan` on one device.

    ``requires`` checks the plan was made for this step, then ``check_targets``. ``run`` returns the
    step unchanged (``{count_stat: 0}``) when ``targets`` finds nothing, else ``rewrite``s a copy.
    """

    Options: ClassVar[type] = PlanOptions
    #: The stats key that counts rewrites; 0 when there is nothing to rewrite.
    count_stat: ClassVar[str]
    #: Whether the targets are param slots whose gradient nodes (``recir.grad_of``) must exist.
    needs_grads: ClassVar[bool] = False

    @abc.abstractmethod
    def targets(self, step: StepGraph) -> Sequence[Any]:
        """What this transform rewrites in ``step`` under the plan (slot names, output positions)."""

    def check_targets(self, step: StepGraph, targets: Sequence[Any]) -> None:
        """Raise ConfigError if the targets cannot be rewritten (by default: a missing gradient node)."""
        if self.needs_grads:
            require_grads(step, list(targets), self.name)

    def params_placed(self, step: StepGraph, key: str, value: str) -> list[str]:
        """The param slots whose placement in the plan has ``key == value``, in signature order."""
        slots = self.options.plan.slots
        return [s.name for s in step.signature.state if s.kind == "param" and slots[s.name].get(key) == value]

    @abc.abstractmethod
    def rewrite(self, step: StepGraph, targets: Sequence[Any]) -> TransformResult:
        """Rewrite ``step`` (already a private copy) in place and recompute its ``val``s (``repropagate``)."""

    def requires(self, step: StepGraph) -> None:
        check_plan_matches(step, self.options.plan, self.options.rank, self.name)
        self.check_targets(step, self.targets(step))

    def run(self, step: StepGraph) -> TransformResult:
        targets = self.targets(step)
        if not targets:
            return TransformResult(step, False, {self.count_stat: 0})
        return self.rewrite(step.copy(), targets)
