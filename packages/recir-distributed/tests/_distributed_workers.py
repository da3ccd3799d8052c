"""Worker bodies for the multi-process tests: each spawned rank builds its per-device program, trains,
gathers the state back and compares it with single-process training on the same global batch.
"""

from __future__ import annotations

import math
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RECIR_VERIFY="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Every rank passed its checks and met at the barrier: leave without Python's and C++'s teardown.
    # Gloo's threads could still be joinable when the process ran its destructors, and std::terminate
    # then aborted the rank (SIGABRT, "terminate called without an active exception": seen twice in CI,
    # after every check had passed), failing a test that had succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., None], world: int, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo CPU processes; a failure in any rank fails the test."""
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)


def train_and_compare_all(rank: int, world: int, cases: list[tuple[str, list[Any], int]]) -> None:
    """Several ``(kind, modes, steps)`` cases in one spawn (each spawn costs a torch import per rank)."""
    for kind, modes, steps in cases:
        if kind == "captured":
            captured_train_and_compare(rank, world, modes, steps)
        elif kind == "torchrec":
            from _distributed_dp_workers import torchrec_split_train_and_compare

            torchrec_split_train_and_compare(rank, world, modes, steps)
        else:
            train_and_compare(rank, world, kind, modes, steps)


def train_and_compare(rank: int, world: int, kind: str, modes: list[Any], steps: int = 10) -> None:
    """For each mode: train ``steps`` steps distributed, gather, compare params + optimizer state + loss.

    A mode is anything ``recir.distributed.plan`` takes, or ``("auto", memory_budget)``.
    """
    import _distributed_models as M
    import recir.distributed as rd

    local_b = 4
    if kind == "mlp":
        local_step, global_step = M.mlp_step(local_b), M.mlp_step(local_b * world)
        make_batch, params = M.mlp_batch, M.MLP_PARAMS
    else:
        seq = kind == "seq"
        local_step, global_step = M.emb_step(local_b, seq), M.emb_step(local_b * world, seq)
        make_batch, params = M.emb_batch, M.EMB_PARAMS
    full0 = M.init_state(params)

    # single-process reference on the global batch (the concatenation of every rank's local batch)
    ref = global_step.load_state_dict(full0)
    ref_losses = []
    for k in range(steps):
        per_rank = [make_batch(local_b, k, seed=1 + r) for r in range(world)]
        gb = [torch.cat(x) for x in zip(*per_rank)] if kind == "mlp" else M.concat_batches(per_rank)
        ref, out = global_step(ref, gb)
        ref_losses.append(float(out[0]))
    ref_sd = global_step.state_dict(ref)

    mesh = rd.Mesh(axes={"data": world})
    for mode in modes:
        budget = None
        if isinstance(mode, tuple):
            mode, budget = mode
        plan = rd.plan(local_step, mode, mesh, memory_budget=budget)
        dstep = rd.distribute(local_step, plan, rank)
        state = rd.shard_state(plan, dstep, full0, rank)
        held = sum(t.numel() * t.element_size() for t in state)
        assert held == plan.bytes_per_device()[rank], (mode, held, plan.bytes_per_device())
        for slot, t in zip(dstep.signature.state, state):
            assert tuple(t.shape) == plan.local_shape(slot.name, rank), (mode, slot.name)
        losses = []
        for k in range(steps):
            state, out = dstep(state, make_batch(local_b, k, seed=1 + rank))
            losses.append(float(out[0]))
        for slot, t in zip(dstep.signature.state, state):
            assert tuple(t.shape) == tuple(slot.shape), (mode, slot.name, t.shape)
        gathered = rd.gather_state(plan, dstep, state)
        # resharding into the FSDP layout gives exactly the FSDP shards of the gathered state
        fsdp = rd.plan(local_step, "fsdp", mesh)
        moved = rd.reshard(plan, dstep, state, fsdp, local_step, rank)
        for slot, t in zip(local_step.signature.state, moved):
            assert torch.equal(t, rd.shard_tensor(fsdp, slot.name, gathered[slot.name], rank)), slot.name
        for name, want in ref_sd.items():
            got = gathered[name]
            assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (
                f"{mode}: {name} differs from single-process training by "
                f"{(got - want).abs().max().item():.3g}"
            )
        assert all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5) for a, b in zip(losses, ref_losses)), (
            mode,
            losses,
            ref_losses,
        )
        full_bytes = sum(t.numel() * t.element_size() for t in full0.values())
        if plan.mode != "DataParallel":
            assert held < full_bytes, (mode, held, full_bytes)


# -- a captured nn.Module (recir.capture) with nn.EmbeddingBag tables and torch.optim.Adam ---------------
def _captured_model(seed: int = 0):  # noqa: ANN202
    from torch import nn

    torch.manual_seed(seed)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user = nn.EmbeddingBag(16, 4, mode="sum", include_last_offset=True)
            self.item = nn.EmbeddingBag(12, 4, mode="mean", include_last_offset=True)
            self.fc = nn.Linear(11, 8)
            self.head = nn.Linear(8, 1)

        def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
            u = self.user(b["user_ids"], b["user_offsets"])
            i = self.item(b["item_ids"], b["item_offsets"])
            h = torch.relu(self.fc(torch.cat([u, i, b["dense"]], 1)))
            return self.head(h).squeeze(1)

    model = Model()
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _loss(model, batch):  # noqa: ANN001, ANN202
    return ((model(batch) - batch["label"]) ** 2).mean()


def _as_dict(flat: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    keys = ["dense", "user_ids", "user_offsets", "item_ids", "item_offsets", "label"]
    return dict(zip(keys, flat))


def captured_train_and_compare(rank: int, world: int, modes: list[Any], steps: int = 10) -> None:
    """recir.capture's StepGraph of a real nn.Module: distributed training matches one process."""
    import _distributed_models as M
    import recir.distributed as rd
    from recir.capture import capture_train_step
    from recir.embedding import EmbeddingBagOverride

    local_b = 4
    model, opt = _captured_model()
    per_rank0 = [M.emb_batch(local_b, 0, seed=1 + r) for r in range(world)]
    local_step = capture_train_step(
        model, opt, _loss, _as_dict(per_rank0[rank]), overrides=[EmbeddingBagOverride()]
    )
    global_step = capture_train_step(
        model, opt, _loss, _as_dict(M.concat_batches(per_rank0)), overrides=[EmbeddingBagOverride()]
    )
    ref = global_step.init_state(model, opt)
    for k in range(steps):
        gb = M.concat_batches([M.emb_batch(local_b, k, seed=1 + r) for r in range(world)])
        ref, _ = global_step(ref, _as_dict(gb))
    ref_sd = global_step.state_dict(ref)
    mesh = rd.Mesh(axes={"data": world})
    for mode in modes:
        plan = rd.plan(local_step, mode, mesh)
        dstep = rd.distribute(local_step, plan, rank)
        state = dstep.init_state(model, opt)  # this rank's shards, straight from the live model
        assert sum(t.numel() * t.element_size() for t in state) == plan.bytes_per_device()[rank]
        for k in range(steps):
            state, _ = dstep(state, _as_dict(M.emb_batch(local_b, k, seed=1 + rank)))
        gathered = rd.gather_state(plan, dstep, state)
        for name, want in ref_sd.items():
            got = gathered[name]
            assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (
                f"{mode}: {name} differs by {(got - want).abs().max().item():.3g}"
            )


def compiled_matches_eager(rank: int, world: int, kind: str, modes: list[str], steps: int = 3) -> None:
    """recir.lower_gpu.compile of this rank's program (Inductor, CPU) matches the eager interpreter."""
    import _distributed_models as M
    import recir.distributed as rd
    from recir.lower_gpu import compile as lower

    step = M.mlp_step(4) if kind == "mlp" else M.emb_step(4)
    params, make_batch = (M.MLP_PARAMS, M.mlp_batch) if kind == "mlp" else (M.EMB_PARAMS, M.emb_batch)
    for mode in modes:
        plan = rd.plan(step, mode, rd.Mesh(axes={"data": world}))
        dstep = rd.distribute(step, plan, rank)
        compiled = lower(dstep, plan, device="cpu")
        eager = rd.shard_state(plan, dstep, M.init_state(params), rank)
        fast = [t.clone() for t in eager]
        for k in range(steps):
            batch = make_batch(4, k, seed=1 + rank)
            eager, eager_out = dstep(eager, batch)
            fast, fast_out = compiled(fast, batch)
        for slot, a, b in zip(dstep.signature.state, eager, fast):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (mode, slot.name, (a - b).abs().max().item())
        assert torch.allclose(eager_out[0], fast_out[0], atol=1e-6)


def pipelined_matches_unpipelined(
    rank: int, world: int, cases: list[tuple[str, int, bool]], steps: int = 5
) -> None:
    """recir-pipeline-sparse on this rank's program: each ``(mode, stages, compiled)`` case trains ``steps``
    batches pipelined and unpipelined; parameters, Adam moments and every loss must agree (bit for bit on
    the interpreter, 1e-6 through recir.lower_gpu)."""
    import _distributed_models as M
    import recir.distributed as rd
    from recir.transforms import PipelinedStep

    step = M.emb_step(4, hashed=True)
    batches = [M.emb_batch(4, k, seed=1 + rank) for k in range(steps)]
    for mode, stages, compiled in cases:
        plan = rd.plan(step, mode, rd.Mesh(axes={"data": world}))
        dstep = rd.distribute(step, plan, rank)
        lower: Any = None
        if compiled:
            from functools import partial

            from recir.lower_gpu import compile as lower_gpu

            lower = partial(lower_gpu, plan=plan, device="cpu")
        pipe = PipelinedStep.build(dstep, stages=stages, compile=lower)
        ref_step = lower(dstep) if compiled else dstep
        init = rd.shard_state(plan, dstep, M.init_state(M.EMB_PARAMS), rank)
        ref, ref_losses = [t.clone() for t in init], []
        for batch in batches:
            ref, out = ref_step(ref, batch)
            ref_losses.append(out[0])
        state = pipe.load_state_dict(dstep.state_dict([t.clone() for t in init]))  # carries start as zeros
        ran = list(pipe.run(state, batches))
        state, losses = ran[-1][0], [out[0] for _, out in ran]
        tol = 1e-6 if compiled else 0.0
        for slot, a, b in zip(dstep.signature.state, state, ref):
            diff = (
                (a - b).abs().max().item() if a.numel() else 0.0
            )  # a table_wise table held elsewhere: empty
            assert diff <= tol, (mode, stages, slot.name, diff)
        assert len(losses) == steps
        assert all((a - b).abs().item() <= tol for a, b in zip(losses, ref_losses)), (
            mode,
            losses,
            ref_losses,
        )
