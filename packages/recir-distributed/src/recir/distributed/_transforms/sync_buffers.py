"""``recir-dist-sync-buffers``: average every updated floating-point buffer (BatchNorm running statistics)
over the data-parallel group, so replicated buffers stay identical on all ranks.

Before::                                          After::

    %bn = _native_batch_norm_legit_functional(...)    %bn = _native_batch_norm_legit_functional(...)
    %rm = getitem(%bn, 3)  # forward                  %rm = getitem(%bn, 3)  # forward
    return [..., %rm, ...]                            %ar = _c10d_functional.all_reduce(%rm, 'avg', '0')
                                                      %rm_avg = _c10d_functional.wait_tensor(%ar)
                                                      return [..., %rm_avg, ...]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch.fx as fx
from recir.transforms import PHASE_KEY, StepGraph, TransformResult, register_transform

from .._graphinfo import source_of, state_placeholders
from .._rewrite import C10D, collective, repropagate
from ._common import PlanTransform


@register_transform
class SyncBuffers(PlanTransform):
    name: ClassVar[str] = "recir-dist-sync-buffers"
    summary: ClassVar[str] = (
        "all-reduce (mean) the new value of every updated floating-point buffer:* slot over the data group "
        "(BatchNorm running statistics); integer buffers (num_batches_tracked) stay local"
    )
    count_stat: ClassVar[str] = "buffers"

    def targets(self, step: StepGraph) -> list[int]:
        """Output positions of buffer slots whose new value is computed (not the input passed through)."""
        if self.options.plan.mesh.data_size <= 1:
            return []
        phs = state_placeholders(step)
        out = next(n for n in step.graph.nodes if n.op == "output")
        values = list(out.args[0])
        return [
            i
            for i, s in enumerate(step.signature.state)
            if s.kind == "buffer"
            and s.dtype.is_floating_point
            and self.options.plan.slots[s.name].get("placement") != "shard"
            and isinstance(values[i], fx.Node)
            and source_of(values[i]) is not phs[s.name]
        ]

    def rewrite(self, step: StepGraph, targets: Sequence[int]) -> TransformResult:
        plan = self.options.plan
        graph = step.graph
        out = next(n for n in graph.nodes if n.op == "output")
        values = list(out.args[0])
        for i in targets:
            value, slot = values[i], step.signature.state[i]
            with graph.inserting_before(value.next):  # right after the update: overlaps the backward
                avg = collective(
                    graph,
                    C10D.all_reduce.default,
                    (value, "avg", plan.group_name),
                    phase=value.meta.get(PHASE_KEY, "forward"),
                    sharding={**plan.slots[slot.name], "role": "buffer"},
                )
            values[i] = avg
        out.args = (tuple(values),)
        repropagate(step, self.name)
        return TransformResult(step, True, {"buffers": len(targets)})
