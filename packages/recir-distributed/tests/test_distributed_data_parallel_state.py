"""State that data-parallel ranks would otherwise get wrong: per-rank random streams
(recir-dist-fold-rng-rank: dropout draws a different mask on every rank while the stored rng state,
parameters and optimizer state stay identical across ranks) and BatchNorm running statistics
(recir-dist-sync-buffers: averaged over the ranks after every step).
"""

from __future__ import annotations

import _distributed_models as M
import recir.distributed as rd
import torch
from _distributed_dp_workers import run_checks
from _distributed_workers import spawn
from recir.distributed._transforms.fold_rng_rank import GOLDEN, folded_seed_delta
from recir.transforms import SHARDING_KEY


def test_two_ranks_draw_independent_dropout_streams_and_share_batchnorm_statistics():
    checks = ["dropout_streams_differ", "dropout_zero_matches_one_process", "batchnorm_buffers_synchronised"]
    spawn(run_checks, 2, checks)


def test_fold_rng_rank_graph():
    from recir.capture import capture_train_step
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = capture_train_step(model, opt, lambda m, b: m(b).sum(), torch.randn(2, 3))
    mesh = rd.Mesh(axes={"data": 4})
    plan = rd.plan(step, "data_parallel", mesh)
    fold = rd.FoldRngRank(plan=plan, rank=3)
    result = fold(step)
    assert result.changed and result.stats["data_index"] == 3
    adds = [
        n
        for n in result.step.graph.nodes
        if n.target is torch.ops.aten.add.Tensor and n.args[1] == folded_seed_delta(3)
    ]
    assert len(adds) == 1 and folded_seed_delta(3) == (3 * GOLDEN) & 0xFFFFFFFF
    # the stored seed passes through unchanged; only the random ops read the folded one
    seed_ph = next(n for n in result.step.graph.nodes if n.name == "rng_seed")
    out = next(n for n in result.step.graph.nodes if n.op == "output")
    names = [s.name for s in step.signature.state]
    assert out.args[0][names.index("rng:seed")] is seed_ph
    assert [u.target for u in seed_ph.users if u is not out] == [torch.ops.aten.bitwise_and.Scalar]
    state = step.init_state(model, opt)
    batch = torch.randn(2, 3)
    new, _ = result.step(state, batch)
    old, _ = step(state, batch)
    sd_new, sd_old = result.step.state_dict(new), step.state_dict(old)
    assert torch.equal(sd_new["rng:seed"], sd_old["rng:seed"])
    assert torch.equal(sd_new["rng:offset"], sd_old["rng:offset"])
    assert not torch.equal(sd_new["param:0.weight"], sd_old["param:0.weight"])  # another mask
    # one data-parallel device, or a step without randomness: nothing to fold
    assert (
        not rd.FoldRngRank(plan=rd.plan(step, "data_parallel", rd.Mesh(axes={"data": 1}))).run(step).changed
    )
    plain = M.mlp_step(4)
    assert not rd.FoldRngRank(plan=rd.plan(plain, "data_parallel", mesh), rank=1).run(plain).changed


def test_sync_buffers_graph():
    from recir.capture import capture_train_step
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = capture_train_step(model, opt, lambda m, b: m(b).sum(), torch.randn(2, 3))
    plan = rd.plan(step, "data_parallel", rd.Mesh(axes={"data": 2}))
    result = rd.SyncBuffers(plan=plan, rank=1)(step)
    assert result.changed and result.stats == {"buffers": 2}
    out = next(n for n in result.step.graph.nodes if n.op == "output")
    names = [s.name for s in step.signature.state]
    synced = {
        name
        for name, v in zip(names, out.args[0])
        if v.target is torch.ops._c10d_functional.wait_tensor.default
        and v.meta[SHARDING_KEY].get("role") == "buffer"
    }
    assert synced == {"buffer:1.running_mean", "buffer:1.running_var"}  # not num_batches_tracked
    one = rd.plan(step, "data_parallel", rd.Mesh(axes={"data": 1}))
    assert not rd.SyncBuffers(plan=one).run(step).changed
