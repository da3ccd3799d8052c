"""Worker for the resharding-checkpoint test: train under one plan, save sharded, load under another plan
(same world, another mode), continue, and compare with one process training on the global batch.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

LOCAL_B = 4


def reference(world: int, steps: int) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(losses, state after ``steps // 2`` steps, state after ``steps``) of one process on the global batch."""
    import _distributed_models as M

    gstep = M.emb_step(LOCAL_B * world)
    state = gstep.load_state_dict(M.init_state(M.EMB_PARAMS))
    losses, half = [], {}
    for k in range(steps):
        if k == steps // 2:
            half = gstep.state_dict(state)
        gb = M.concat_batches([M.emb_batch(LOCAL_B, k, seed=1 + r) for r in range(world)])
        state, out = gstep(state, gb)
        losses.append(float(out[0]))
    return losses, half, gstep.state_dict(state)


def save_then_reshard(rank: int, world: int, directory: str, save_mode: object, load_mode: object) -> None:
    import _distributed_models as M
    import recir.distributed as rd

    steps = 6
    ref_losses, _, ref_final = reference(world, steps)
    local = M.emb_step(LOCAL_B)
    mesh = rd.Mesh(axes={"data": world})
    plan = rd.plan(local, save_mode, mesh)
    dstep = rd.distribute(local, plan, rank)
    state = rd.shard_state(plan, dstep, M.init_state(M.EMB_PARAMS), rank)
    for k in range(steps // 2):
        state, _ = dstep(state, M.emb_batch(LOCAL_B, k, seed=1 + rank))
    names = [s.name for s in dstep.signature.state]
    # a first save, overwritten by the second: the rename keeps exactly one complete checkpoint
    rd.save_sharded(directory, dict(zip(names, state)), plan, rank, meta={"step": 0})
    rd.save_sharded(directory, dict(zip(names, state)), plan, rank, meta={"step": steps // 2})
    files = sorted(p.name for p in Path(directory).iterdir())
    assert any(f.endswith(".distcp") for f in files) and "plan.json" in files, files
    assert rd.saved_plan(directory) == plan

    new_plan = rd.plan(local, load_mode, mesh)
    new_step = rd.distribute(local, new_plan, rank)
    loaded = rd.load_resharded(directory, new_plan, rank)
    state = [loaded[s.name] for s in new_step.signature.state]
    for s, t in zip(new_step.signature.state, state):
        assert tuple(t.shape) == tuple(s.shape), (s.name, t.shape, s.shape)
    losses = []
    for k in range(steps // 2, steps):
        state, out = new_step(state, M.emb_batch(LOCAL_B, k, seed=1 + rank))
        losses.append(float(out[0]))
    gathered = rd.gather_state(new_plan, new_step, state)
    for name, want in ref_final.items():
        assert torch.allclose(gathered[name], want, atol=2e-5, rtol=1e-4), name
    assert all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5) for a, b in zip(losses, ref_losses[3:]))


def load_on_four(rank: int, world: int, directory: str) -> None:
    """A 2-rank checkpoint read by 4 ranks under row-wise tables + FSDP: each block is the global state's."""
    import _distributed_models as M
    import recir.distributed as rd

    _, half, _ = reference(2, 6)
    local = M.emb_step(LOCAL_B)
    plan = rd.plan(
        local,
        rd.HybridParallel(tables=rd.row_wise(), dense=rd.FullyShardedDataParallel()),
        rd.Mesh(axes={"data": world}),
    )
    loaded = rd.load_resharded(directory, plan, rank)
    assert set(loaded) == set(plan.slots)
    for name, t in loaded.items():
        assert tuple(t.shape) == plan.local_shape(name, rank), name
        want = rd.shard_tensor(plan, name, half[name], rank)
        assert torch.allclose(t, want, atol=2e-5, rtol=1e-4), name
