"""``recir-dist-shard-params``: FSDP. Each device keeps 1/D of a parameter and of its optimizer state
(dim 0); the forward all-gathers it, the gradient is reduce-scattered, the optimizer updates the shard.

Before (w: [8, 4])::                          After (w: [4, 4] on each of 2 devices)::

    %h = mm(%x, %w)  # forward                    %ag = all_gather_into_tensor(%w, 2, '0')  # forward
    %g = mm(%t, %x)  # backward                   %w_full = wait_tensor(%ag)
    %w2 = sub(%w, %g)  # optimizer                %h = mm(%x, %w_full)  # forward
                                                  %g = mm(%t, %x)  # backward
                                                  %rs = reduce_scatter_tensor(%g, 'avg', 2, '0')  # backward
                                                  %g_shard = wait_tensor(%rs)
                                                  %w2 = sub(%w, %g_shard)  # optimizer   ([4, 4])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.fx as fx
from recir.transforms import PHASE_KEY, ConfigError, StepGraph, TransformResult, register_transform

from .._graphinfo import aliases_of, require_grads, state_placeholders
from .._rewrite import C10D, collective, repropagate, with_local_state
from ._common import PlanTransform

# Reductions that would silently compute a per-shard value inside a sharded optimizer update.
_REDUCTIONS = (
    "sum",
    "mean",
    "norm",
    "linalg_vector_norm",
    "amax",
    "amin",
    "max",
    "min",
    "var",
    "std",
    "prod",
)


@register_transform
class ShardParameters(PlanTransform):
    name: ClassVar[str] = "recir-dist-shard-params"
    summary: ClassVar[str] = (
        "FSDP: all-gather sharded params for compute, reduce-scatter grads, update shards"
    )
    count_stat: ClassVar[str] = "sharded_params"
    needs_grads: ClassVar[bool] = True

    def targets(self, step: StepGraph) -> list[str]:
        return self.params_placed(step, "scheme", "fsdp")

    def rewrite(self, step: StepGraph, targets: Sequence[str]) -> TransformResult:
        plan, rank = self.options.plan, self.options.rank
        graph = step.graph
        phs = state_placeholders(step)
        grads = require_grads(step, list(targets), self.name)
        first_compute = next(n for n in graph.nodes if n.op != "placeholder")
        for slot in targets:
            sh = plan.slots[slot]
            n = sh["num_shards"]
            ph = phs[slot]
            for alias in aliases_of(ph)[1:]:  # the optimizer updates the shard, even through a detach
                for user in list(alias.users):
                    if user.meta.get(PHASE_KEY) == "optimizer":
                        user.replace_input_with(alias, ph)
            compute_users = [
                u for u in ph.users if u.op == "call_function" and u.meta.get(PHASE_KEY) != "optimizer"
            ]
            if compute_users:
                with graph.inserting_before(first_compute):
                    full = collective(
                        graph,
                        C10D.all_gather_into_tensor.default,
                        (ph, n, plan.group_name),
                        phase="forward",
                        sharding={**sh, "role": "gather"},
                    )
                for user in compute_users:
                    user.replace_input_with(ph, full)
            g = grads[slot]
            with graph.inserting_before(g.next):
                shard = collective(
                    graph,
                    C10D.reduce_scatter_tensor.default,
                    (g, "avg", n, plan.group_name),
                    phase=g.meta[PHASE_KEY],
                    sharding={**sh, "role": "gradient"},
                )
            for user in list(g.users):
                if user is not shard.args[0] and (
                    user.op == "output" or user.meta.get(PHASE_KEY) == "optimizer"
                ):
                    user.replace_input_with(g, shard)
        sharded = {
            s.name: plan.local_shape(s.name, rank)
            for s in step.signature.state
            if plan.slots[s.name].get("scheme") == "fsdp"
        }
        step = with_local_state(step, sharded)
        repropagate(step, self.name)
        _check_elementwise(step, [phs[s] for s in sharded], self.name)
        return TransformResult(step, True, {"sharded_params": len(targets), "sharded_slots": len(sharded)})


def _check_elementwise(step: StepGraph, shards: list[fx.Node], name: str) -> None:
    """Refuse optimizer updates that reduce over a sharded tensor (gradient clipping, global norms)."""
    tainted = set(shards)
    for node in step.graph.nodes:
        if node.target is C10D.reduce_scatter_tensor.default:
            tainted.add(node)  # a gradient shard
        if node.op != "call_function" or not any(a in tainted for a in node.all_input_nodes):
            continue
        if node.target is C10D.all_gather_into_tensor.default:
            continue  # the gathered parameter is whole again
        tainted.add(node)
        if node.meta.get(PHASE_KEY) != "optimizer" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        base = node.target._schema.name.split("::")[-1]
        val, src = node.meta.get("val"), node.args[0] if node.args else None
        src_val = src.meta.get("val") if isinstance(src, fx.Node) else None
        if (
            base in _REDUCTIONS
            and isinstance(val, torch.Tensor)
            and isinstance(src_val, torch.Tensor)
            and val.numel() < src_val.numel()
            and not _keeps_dim0(node, src_val)
        ):
            raise ConfigError(
                f"{name}: optimizer node %{node.name} ({base}) reduces over a sharded tensor; under FSDP it "
                "would see one shard only (gradient clipping or a global norm). Fix: replicate those "
                "parameters (DataParallel) or drop the clipping."
            )


def _keeps_dim0(node: fx.Node, src: torch.Tensor) -> bool:
    """A reduction over dims other than 0 (FSDP's shard dim) stays row-local, e.g. RowWiseAdagrad's
    per-row ``mean(g * g, dim=1)``: every device reduces whole rows of its own shard."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or not dims or src.dim() < 2:
        return False
    return all(isinstance(d, int) and d % src.dim() != 0 for d in dims)
