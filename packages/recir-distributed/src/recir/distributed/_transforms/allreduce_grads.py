"""``recir-dist-allreduce-grads``: average the gradient of every replicated parameter over the mesh.

Before::                                  After::

    %g = mm(%t, %x)  # backward               %g = mm(%t, %x)  # backward
    %p2 = sub(%w, %g)  # optimizer            %ar = _c10d_functional.all_reduce(%g, 'avg', '0')  # backward
                                              %g_avg = _c10d_functional.wait_tensor(%ar)  # backward
                                              %p2 = sub(%w, %g_avg)  # optimizer
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from recir.transforms import (
    PHASE_KEY,
    SHARDING_KEY,
    StepGraph,
    TransformResult,
    grad_nodes,
    register_transform,
)

from .._rewrite import C10D, collective, repropagate
from ._common import PlanOptions, PlanTransform


@dataclass(frozen=True, eq=False)
class AllReduceGradientsOptions(PlanOptions):
    """``average_loss`` also averages the first user output (the loss) so every rank reports the global loss."""

    average_loss: bool = True


@register_transform
class AllReduceGradients(PlanTransform):
    name: ClassVar[str] = "recir-dist-allreduce-grads"
    summary: ClassVar[str] = (
        "all-reduce (mean) the gradient of each replicated parameter at its recir.grad_of node"
    )
    Options: ClassVar[type] = AllReduceGradientsOptions
    count_stat: ClassVar[str] = "all_reduces"
    needs_grads: ClassVar[bool] = True

    def targets(self, step: StepGraph) -> list[str]:
        return self.params_placed(step, "grad", "all_reduce")

    def rewrite(self, step: StepGraph, targets: Sequence[str]) -> TransformResult:
        plan = self.options.plan
        graph = step.graph
        grads = grad_nodes(step)
        count = 0
        for slot in targets:
            g = grads[slot]
            with graph.inserting_before(g.next):
                avg = collective(
                    graph,
                    C10D.all_reduce.default,
                    (g, "avg", plan.group_name),
                    phase=g.meta[PHASE_KEY],
                    sharding={**plan.slots[slot], "role": "gradient"},
                )
            g.replace_all_uses_with(avg, delete_user_cb=lambda u, start=avg.args[0]: u is not start)
            count += 1
        if self.options.average_loss and step.signature.outputs:
            out = next(n for n in graph.nodes if n.op == "output")
            loss = out.args[0][len(step.signature.state)]
            with graph.inserting_before(out):
                avg = collective(
                    graph,
                    C10D.all_reduce.default,
                    (loss, "avg", plan.group_name),
                    phase=loss.meta.get(PHASE_KEY, "forward"),
                )
            out.replace_input_with(loss, avg)
            avg.meta[SHARDING_KEY] = {"placement": "replicate", "role": "loss"}
        repropagate(step, self.name)
        return TransformResult(step, True, {"all_reduces": count})
