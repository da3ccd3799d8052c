"""Worker bodies for per-rank random streams (dropout), jagged batch splits and synchronised buffers:
captured nn.Modules (recir.capture) trained on gloo processes and compared across ranks and with one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

STEPS = 3


def _dropout_model(p: float):  # noqa: ANN202
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(p), nn.Linear(8, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _loss_and_pred(model: nn.Module, batch: dict[str, torch.Tensor]):  # noqa: ANN202
    pred = model(batch["x"]).squeeze(1)
    return ((pred - batch["y"]) ** 2).mean(), pred


def _dense_batch(n: int, k: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + k)
    return {"x": torch.randn(n, 4, generator=g), "y": torch.randn(n, generator=g)}


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.detach().contiguous())
    return parts


def _assert_same_on_all_ranks(state: dict[str, torch.Tensor], what: str) -> None:
    for name, t in state.items():
        parts = _gather(t)
        assert all(torch.equal(parts[0], q) for q in parts[1:]), f"{what}: {name} differs across ranks"


def dropout_streams_differ(rank: int, world: int) -> None:
    """p=0.5, the SAME local batch on every rank: masks (and so the local losses) differ per rank, while
    parameters, optimizer and rng state stay bit-identical; rank 0 draws the single-process stream."""
    import recir.distributed as rd
    from recir.capture import capture_train_step

    model, opt = _dropout_model(0.5)
    step = capture_train_step(model, opt, _loss_and_pred, _dense_batch(4, 0))
    plan = rd.plan(step, "data_parallel", rd.Mesh(axes={"data": world}))
    dstep = rd.distribute(step, plan, rank)
    names = [s.name for s in dstep.signature.state]
    assert "rng:seed" in names and dstep.signature.state == step.signature.state
    torch.manual_seed(100 + rank)  # ranks seed torch differently: init_state still agrees on rng:seed
    state = dstep.init_state(model, opt)
    ref = step.load_state_dict(dstep.state_dict(state))  # one process, the same initial state and seed
    for k in range(STEPS):
        batch = _dense_batch(4, k)  # identical on every rank
        state, (_, pred) = dstep(state, batch)
        ref, (_, ref_pred) = step(ref, batch)
        preds = _gather(pred)
        local_losses = [float(((p - batch["y"]) ** 2).mean()) for p in preds]
        assert len(set(local_losses)) == world, f"step {k}: per-rank losses {local_losses} (masks equal?)"
        if k == 0:  # same parameters at step 0: data index 0 draws exactly the single-process mask
            assert torch.equal(preds[0], ref_pred), (preds[0], ref_pred)
        _assert_same_on_all_ranks(dstep.state_dict(state), f"after step {k}")
    got, want = dstep.state_dict(state), step.state_dict(ref)
    assert int(got["rng:offset"]) == int(want["rng:offset"]) == STEPS, (got["rng:offset"], want["rng:offset"])
    assert int(got["rng:seed"]) == int(want["rng:seed"])


def dropout_zero_matches_one_process(rank: int, world: int) -> None:
    """p=0: 2-rank training on per-rank batches matches one process on the global batch (params + Adam)."""
    import recir.distributed as rd
    from recir.capture import capture_train_step

    model, opt = _dropout_model(0.0)
    local = [_dense_batch(4, 0, seed=1 + r) for r in range(world)]
    glob = {key: torch.cat([b[key] for b in local]) for key in local[0]}
    step = capture_train_step(model, opt, _loss_and_pred, local[rank])
    gstep = capture_train_step(model, opt, _loss_and_pred, glob)
    plan = rd.plan(step, "data_parallel", rd.Mesh(axes={"data": world}))
    dstep = rd.distribute(step, plan, rank)
    state = dstep.init_state(model, opt)
    ref = gstep.load_state_dict(dstep.state_dict(state))
    for k in range(STEPS):
        per_rank = [_dense_batch(4, k, seed=1 + r) for r in range(world)]
        state, (loss, _) = dstep(state, per_rank[rank])
        ref, (ref_loss, _) = gstep(ref, {key: torch.cat([b[key] for b in per_rank]) for key in per_rank[0]})
        assert torch.allclose(loss, ref_loss, atol=1e-6, rtol=1e-5), (k, loss, ref_loss)
    want = gstep.state_dict(ref)
    for name, got in dstep.state_dict(state).items():
        assert torch.allclose(got.float(), want[name].float(), atol=2e-6, rtol=1e-5), name


def batchnorm_buffers_synchronised(rank: int, world: int) -> None:
    """BatchNorm1d on the input: per-rank batches differ, yet after each step both ranks hold the same
    running statistics; running_mean equals one process's on the global batch, running_var is the mean
    of the ranks' local (unbiased) variances; num_batches_tracked counts steps on every rank."""
    import recir.distributed as rd
    from recir.capture import capture_train_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    per_rank = [_dense_batch(4, 0, seed=1 + r) for r in range(world)]
    step = capture_train_step(model, opt, _loss_and_pred, per_rank[rank])
    gstep = capture_train_step(
        model, opt, _loss_and_pred, {k: torch.cat([b[k] for b in per_rank]) for k in per_rank[0]}
    )
    mesh = rd.Mesh(axes={"data": world})
    for mode in ["data_parallel", "fsdp"]:
        plan = rd.plan(step, mode, mesh)
        dstep = rd.distribute(step, plan, rank)
        state = dstep.init_state(model, opt)
        ref = gstep.init_state(model, opt)
        want_var = gstep.state_dict(ref)["buffer:0.running_var"].clone()
        for k in range(STEPS):
            per_rank = [_dense_batch(4, k, seed=1 + r) for r in range(world)]
            state, _ = dstep(state, per_rank[rank])
            ref, _ = gstep(ref, {key: torch.cat([b[key] for b in per_rank]) for key in per_rank[0]})
            local_var = torch.stack([b["x"].var(0, unbiased=True) for b in per_rank]).mean(0)
            want_var = 0.9 * want_var + 0.1 * local_var
            got = dstep.state_dict(state)
            buffers = {n: t for n, t in got.items() if n.startswith("buffer:")}
            _assert_same_on_all_ranks(buffers, f"{mode}, step {k}")
            want = gstep.state_dict(ref)
            assert torch.allclose(got["buffer:0.running_mean"], want["buffer:0.running_mean"], atol=1e-6), (
                mode,
                k,
            )
            assert torch.allclose(got["buffer:0.running_var"], want_var, atol=1e-6), (mode, k)
            assert int(got["buffer:0.num_batches_tracked"]) == k + 1
        # the average of local variances is not the global batch's variance
        assert not torch.allclose(got["buffer:0.running_var"], want["buffer:0.running_var"], atol=1e-4)


# -- a TorchRec EmbeddingBagCollection model fed JaggedBatches split by rd.split_batch ---------------------
def _torchrec_model():  # noqa: ANN202
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name="t1", embedding_dim=4, num_embeddings=20, feature_names=["f1", "f2"]
                    ),
                    EmbeddingBagConfig(
                        name="t2",
                        embedding_dim=3,
                        num_embeddings=12,
                        feature_names=["f3"],
                        pooling=PoolingType.MEAN,
                    ),
                ]
            )
            self.fc = nn.Linear(11 + 3, 1)

        def forward(self, b: dict) -> torch.Tensor:
            pooled = self.ebc(b["features"]).values()
            return self.fc(torch.cat([pooled, b["dense"]], 1)).squeeze(1)

    model = Model()
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _torchrec_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return ((model(batch) - batch["y"]) ** 2).mean()


def _global_jagged_batch(batch_size: int, k: int) -> dict:
    """A global batch: per-sample lengths 0..3 per feature, ids padded to a capacity of 24 per feature."""
    from recir.embedding import JaggedBatch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(7000 + k)
    lengths = torch.randint(0, 4, (3 * batch_size,), generator=g)
    rows = [20] * (2 * batch_size) + [12] * batch_size
    ids = torch.cat([torch.randint(0, r, (int(n),), generator=g) for r, n in zip(rows, lengths.tolist())])
    kjt = KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=ids, lengths=lengths)
    return {
        "features": JaggedBatch.from_kjt(kjt, [24, 24, 24]),
        "dense": torch.randn(batch_size, 3, generator=g),
        "y": torch.randn(batch_size, generator=g),
    }


def torchrec_split_train_and_compare(rank: int, world: int, modes: list, steps: int = 3) -> None:
    """Global JaggedBatches split by rd.split_batch: 2-rank training of a TorchRec EBC model (captured with
    recir.embedding.overrides()) matches one process on the global batch (parameters and Adam state)."""
    import recir.distributed as rd
    from recir.capture import capture_train_step
    from recir.embedding import overrides

    local_b = 4
    model, opt = _torchrec_model()
    example = _global_jagged_batch(local_b * world, 0)
    global_step = capture_train_step(model, opt, _torchrec_loss, example, overrides=overrides())
    mesh = rd.Mesh(axes={"data": world})
    split_plan = rd.plan(global_step, "data_parallel", mesh)
    local_step = capture_train_step(
        model, opt, _torchrec_loss, rd.split_batch(split_plan, example, rank), overrides=overrides()
    )
    ref = global_step.init_state(model, opt)
    start = global_step.state_dict(ref)
    for k in range(steps):
        ref, _ = global_step(ref, _global_jagged_batch(local_b * world, k))
    ref_sd = global_step.state_dict(ref)
    for mode in modes:
        plan = rd.plan(local_step, mode, mesh)
        dstep = rd.distribute(local_step, plan, rank)
        state = rd.shard_state(plan, dstep, start, rank)
        for k in range(steps):
            local = rd.split_batch(plan, _global_jagged_batch(local_b * world, k), rank)
            assert local["features"].capacities == (24, 24, 24) and local["features"].batch_size == local_b
            state, _ = dstep(state, local)
        gathered = rd.gather_state(plan, dstep, state)
        assert set(gathered) == set(ref_sd)
        for name, want in ref_sd.items():
            got = gathered[name]
            assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (
                f"{mode}: {name} differs by {(got.float() - want.float()).abs().max().item():.3g}"
            )


def run_checks(rank: int, world: int, names: list[str]) -> None:
    """Several of this module's checks in one spawn (each spawn costs a torch import per rank)."""
    for name in names:
        globals()[name](rank, world)
