"""``distribute(step, plan, rank)``: the per-device program (collectives explicit), plus the helpers that
move state and batches between the global view and one device's view.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from recir.transforms import ConfigError, DataError, Pipeline, StateSlot, StepGraph
from torch import nn

from ._plan import ShardingPlan, shard_range
from ._rewrite import C10D, COLLECTIVES
from ._transforms.allreduce_grads import AllReduceGradients
from ._transforms.fold_rng_rank import FoldRngRank, data_index
from ._transforms.shard_params import ShardParameters
from ._transforms.shard_tables import ShardTables
from ._transforms.sync_buffers import SyncBuffers

DISTRIBUTED_META = "recir.distributed"


def distribute_pipeline(plan: ShardingPlan, rank: int) -> Pipeline:
    """The transforms that realise ``plan`` for device ``rank``, in order."""
    return Pipeline(
        [
            # Tables first: it rewrites lookups and their gradients before anything reads them.
            ShardTables(plan=plan, rank=rank),
            # FSDP next: its reduce-scatter replaces the all-reduce for the params it shards.
            ShardParameters(plan=plan, rank=rank),
            # Every remaining replicated parameter averages its gradient (and the loss is averaged).
            AllReduceGradients(plan=plan, rank=rank),
            # Updated float buffers (BatchNorm running statistics) are averaged over the data group.
            SyncBuffers(plan=plan, rank=rank),
            # Each data-parallel rank draws its own random stream (dropout masks differ per batch slice).
            FoldRngRank(plan=plan, rank=rank),
        ],
        name="recir-distribute",
    )


def distribute(step: StepGraph, plan: ShardingPlan, rank: int | None = None) -> StepGraph:
    """The program device ``rank`` runs (default: this process's rank): per-device state shapes,
    explicit collectives. ``init_state(model, optimizer)`` on the result returns this device's shards.
    """
    if rank is None:
        rank = _current_rank()
    if plan.world_size > 1:
        plan.mesh.validate(_world_size_or_none())
    global_sig = step.signature
    out = distribute_pipeline(plan, rank).run(step)
    global_state = {s.name: s for s in global_sig.state}
    out = out.replace(initializers=(_ShardInitializer(plan, rank, global_state, step.initializers),))
    out.meta[DISTRIBUTED_META] = {"rank": rank, "plan": plan, "global_signature": global_sig}
    return out


class _ShardInitializer:
    """Resolves a slot from the live model/optimizer at its global shape, then keeps this device's shard."""

    def __init__(self, plan: ShardingPlan, rank: int, slots: Mapping[str, StateSlot], chain: Sequence[Any]):
        self.plan, self.rank, self.slots, self.chain = plan, rank, dict(slots), tuple(chain)

    def __call__(self, slot: StateSlot, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
        from recir.transforms import param_buffer_initializer

        full_slot = self.slots[slot.name]
        for init in (*self.chain, param_buffer_initializer):
            value = init(full_slot, model, optimizer)
            if value is not None:
                if full_slot.kind == "rng" and isinstance(value, torch.Tensor):
                    value = _same_on_every_rank(value, self.plan)
                return shard_tensor(self.plan, slot.name, value, self.rank)
        return None


def _same_on_every_rank(value: torch.Tensor, plan: ShardingPlan) -> torch.Tensor:
    """Rank 0's value of an ``rng:*`` slot (drawn from each process's global generator) on every rank, so the
    stored rng state is rank-independent even when the ranks seeded torch differently."""
    import torch.distributed as dist

    if plan.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return value
    if dist.get_world_size() != plan.world_size:
        return value
    out = value.detach().clone().contiguous()
    dist.broadcast(out, src=0)
    return out


def shard_tensor(plan: ShardingPlan, slot: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """Device ``rank``'s part of the global value ``full`` of state slot ``slot`` (a copy)."""
    dim, start, stop = shard_range(tuple(full.shape), plan.sharding(slot), rank)
    if plan.sharding(slot).get("placement") != "shard":
        return full.detach().clone()
    return full.detach().narrow(dim, start, stop - start).clone()


def shard_state(
    plan: ShardingPlan, step: StepGraph, full_state: Mapping[str, torch.Tensor], rank: int
) -> list[torch.Tensor]:
    """This device's flat state (``step``'s signature order) from a global ``{slot: tensor}`` mapping."""
    return [shard_tensor(plan, s.name, full_state[s.name], rank) for s in step.signature.state]


def gather_state(
    plan: ShardingPlan, step: StepGraph, local_state: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Collectively rebuild the global ``{slot: tensor}`` on every rank (call on all ranks)."""
    import torch.distributed as dist

    out: dict[str, torch.Tensor] = {}
    for slot, t in zip(step.signature.state, local_state):
        sh = plan.sharding(slot.name)
        if sh.get("placement") != "shard":
            out[slot.name] = t.detach().clone()
            continue
        full = torch.empty(plan.shapes[slot.name], dtype=t.dtype)
        if sh.get("scheme") == "table_wise":
            if dist.get_rank() == sh["owner"]:
                full.copy_(t)
            dist.broadcast(full, src=sh["owner"])
        else:
            parts = [torch.empty_like(t) for _ in range(plan.world_size)]
            dist.all_gather(parts, t.detach().contiguous())
            full = torch.cat(parts, dim=sh["dim"])
        out[slot.name] = full
    return out


def reshard(
    from_plan: ShardingPlan,
    from_step: StepGraph,
    local_state: Sequence[torch.Tensor],
    to_plan: ShardingPlan,
    to_step: StepGraph,
    rank: int | None = None,
) -> list[torch.Tensor]:
    """This rank's state under ``to_plan`` from its state under ``from_plan`` (collective: call on all ranks).

    Both plans must be for the same world; resharding a checkpoint to another world size goes through
    :func:`gather_state` on the old world and :func:`shard_state` on the new one.
    """
    if from_plan.world_size != to_plan.world_size:
        raise ConfigError(
            f"reshard: the plans are for {from_plan.world_size} and {to_plan.world_size} devices. Fix: gather the "
            "state (gather_state) and save it, then shard_state it in the new world."
        )
    full = gather_state(from_plan, from_step, local_state)
    return shard_state(to_plan, to_step, full, _current_rank() if rank is None else rank)


def split_batch(plan: ShardingPlan, batch: Any, rank: int) -> Any:
    """Device ``rank``'s contiguous slice (dim 0) of a global batch, by its data-axis coordinate.

    Dense tensors are sliced; 0-d tensors and non-tensors are kept. Any object with a callable
    ``split_samples(parts, index)`` (e.g. ``recir.embedding.JaggedBatch``) is one leaf and splits itself
    (same static capacities on every device).
    """
    import torch.utils._pytree as pytree

    d = plan.mesh.data_size
    index = data_index(plan, rank)
    leaves, spec = pytree.tree_flatten(batch, is_leaf=_splits_itself)
    out = []
    for leaf in leaves:
        if _splits_itself(leaf):
            out.append(leaf.split_samples(d, index))
            continue
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            out.append(leaf)
            continue
        if leaf.shape[0] % d:
            raise DataError(
                f"a batch tensor of {leaf.shape[0]} samples (shape {list(leaf.shape)}) does not split over the "
                f"data-parallel size {d}. Fix: use a global batch that is a multiple of {d} "
                f"(e.g. {leaf.shape[0] // d * d or d} or {(leaf.shape[0] // d + 1) * d})."
            )
        n = leaf.shape[0] // d
        out.append(leaf[index * n : (index + 1) * n])
    return pytree.tree_unflatten(out, spec)


def _splits_itself(x: object) -> bool:
    return not isinstance(x, torch.Tensor) and callable(getattr(x, "split_samples", None))


def communication_bytes(step: StepGraph) -> dict[str, int]:
    """Bytes each collective kind sends from this device per step (from the graph's ``val``s)."""
    out: dict[str, int] = {}
    for node in step.graph.nodes:
        if node.op == "call_function" and node.target in COLLECTIVES:
            src = node.args[0].meta["val"]
            nbytes = src.numel() * src.element_size()
            if node.target == C10D.all_reduce.default:
                nbytes *= 2  # a ring all-reduce is a reduce-scatter plus an all-gather
            key = node.target._schema.name.split("::")[-1]
            out[key] = out.get(key, 0) + nbytes
    return out


def _current_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    raise ConfigError("distribute(step, plan): no rank given and torch.distributed is not initialised")


def _world_size_or_none() -> int | None:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
