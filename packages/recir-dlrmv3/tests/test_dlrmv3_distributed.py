"""`train --parallel hybrid|dp` on 2 gloo processes (the captured step's per-rank program, run by the
StepGraph interpreter: `--target eager-graph`) matches one eager process step for step although the ranks'
halves hold different candidate counts; its sharded checkpoint resumes on one eager process; the TPU
path's `--mesh data=8` matches too; bad meshes/batches are errors.
"""

from __future__ import annotations

import json
import math
import socket

import pytest
import torch
import torch.multiprocessing as mp
from _dlrmv3_workers import SMALL, VARIED, run_rank_modes
from recir.distributed import CheckpointMismatchError
from recir.dlrmv3 import TrainOptions, load_checkpoint, make_data, train
from recir.dlrmv3._cli import main
from recir.dlrmv3._parallel import local_batch
from recir.transforms import ConfigError


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _uneven_split_premise() -> None:
    """Some steps split unevenly: the halves differ in real candidates and in longest sequence."""
    opts = TrainOptions(target="eager", **VARIED)  # type: ignore[arg-type]
    data = make_data(opts.dataset, opts.model_config(), batch_size=opts.batch_size, seed=opts.seed)
    counts, longest = set(), set()
    for step in range(opts.num_train_batches):
        halves = [local_batch(data, step, r, 2) for r in range(2)]
        c = [int(h.num_candidates.sum()) for h in halves]
        m = [int((2 + h.uih_lengths + h.num_candidates).max()) for h in halves]
        counts.add(c[0] != c[1])
        longest.add(m[0] != m[1])
        assert all(float(h.loss_norm.sum()) == sum(c) / 2 for h in halves)  # each rank's share
    assert True in counts and True in longest, (counts, longest)


def _same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    compared = 0
    for key, w in want.items():
        if key.startswith(("param:", "optim:")) and key in got and got[key].shape == w.shape:
            torch.testing.assert_close(got[key], w, rtol=1e-4, atol=1e-6, msg=f"{what} {key}")
            compared += 1  # (a global vs per-parameter optimizer step is laid out differently: skipped)
    assert compared > len([k for k in want if k.startswith("param:")]), (what, compared)


def test_dlrmv3_two_ranks_train_like_one_and_resume_on_one(tmp_path):
    # Several candidates per sample, so the ranks' halves differ in candidate count and longest sequence:
    # the global normalisation (Batch.loss_norm, Batch.max_seq_len) makes the ranks match one process.
    _uneven_split_premise()
    modes = ["hybrid", "dp", "hybrid:layers", "hybrid:pipeline"]  # + --recompute layers, --pipeline_sparse 2
    mp.spawn(run_rank_modes, args=(2, _port(), str(tmp_path), modes), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"modes-rank{r}.json").read_text()) for r in range(2)]
    opts = dict(VARIED, checkpoint_dir=str(tmp_path / "eager"))
    ref = train(TrainOptions(target="eager", **opts), log=lambda _: None)  # type: ignore[arg-type]
    last = f"step-{VARIED['num_train_batches']}"
    expect, _ = load_checkpoint(tmp_path / "eager" / last)
    for mode in modes:
        assert ranks[1][mode]["lines"] == []  # logs from rank 0 only
        parallel, _, extra = mode.partition(":")
        assert any(f"2 rank(s), parallel {parallel}" in line for line in ranks[0][mode]["lines"])
        if extra == "layers":  # the rewrite ran before the plan: this rank's program recomputes the layers
            assert any("--recompute layers: 2 region(s)" in line for line in ranks[0][mode]["lines"])
        if extra == "pipeline":  # the ids' all-to-alls of the next batch run during this batch's step
            assert any(
                "--pipeline_sparse 2: " in line and "collective(s)" in line and " 0 collective" not in line
                for line in ranks[0][mode]["lines"]
            ), ranks[0][mode]["lines"]
            for r in ranks:  # exact: the unpipelined program's losses, bit for bit on the interpreter
                assert r[mode]["losses"] == r["hybrid"]["losses"]
        for r in ranks:
            got = r[mode]["losses"]
            assert len(got) == len(ref.losses) and all(
                math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) for a, b in zip(got, ref.losses)
            ), (mode, got, ref.losses)
        # the final checkpoint (each rank's shards, gathered) holds the eager run's parameters and state
        _same_state(load_checkpoint(tmp_path / mode / last)[0], expect, mode)
    # the hybrid checkpoint holds each rank's shards and the plan; one eager process resumes from step 2
    step2 = tmp_path / "hybrid" / "step-2"
    assert (step2 / "plan.json").is_file() and len(list(step2.glob("*.distcp"))) == 2
    # eager keeps torch's CPU generator where the captured step (no dropout here) keeps no rng slot: the
    # resume names that slot unless --allow_fresh_slots accepts it starting fresh
    eager_opts = dict(VARIED, checkpoint_every=0, target="eager", resume=str(step2))
    with pytest.raises(
        CheckpointMismatchError, match="slot rng:torch_cpu: this run has it, the checkpoint does not"
    ):
        train(TrainOptions(**eager_opts), log=lambda _: None)  # type: ignore[arg-type]
    resumed = train(
        TrainOptions(**eager_opts, allow_fresh_slots=("rng:*",)),  # type: ignore[arg-type]
        log=lambda _: None,
    )
    assert resumed.start_step == 2
    assert all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) for a, b in zip(resumed.losses, ref.losses[2:]))


def test_dlrmv3_parallel_errors(capsys):
    from recir.distributed import Mesh
    from recir.dlrmv3._parallel import check_batch_split

    with pytest.raises(ConfigError, match="does not split over the data-parallel size 2"):
        check_batch_split(7, 2)
    with pytest.raises(ConfigError, match="NAME=SIZE"):
        Mesh.parse("data8")
    with pytest.raises(ConfigError, match="need the captured step"):
        train(TrainOptions(target="eager", parallel="dp", **SMALL), log=lambda _: None)  # type: ignore[arg-type]
    assert main(["train", "--target", "gpu", "--mesh", "data=2"]) == 2
    assert "--mesh is the TPU path's flag" in capsys.readouterr().err
    assert main(["train", "--target", "tpu", "--mesh", "data=4", "--batch_size", "6"]) == 2
    assert "does not split over the data-parallel size 4" in capsys.readouterr().err


@pytest.mark.tpu
def test_dlrmv3_tpu_mesh_data8_matches_one_device(tmp_path):
    import jax

    if jax.device_count() < 8:
        pytest.skip("needs 8 JAX devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    opts = dict(SMALL, num_train_batches=3)
    lines: list[str] = []
    ckpt = str(tmp_path / "ckpt")
    meshed = train(
        TrainOptions(target="tpu", mesh="data=8", checkpoint_dir=ckpt, checkpoint_every=1, **opts),  # type: ignore[arg-type]
        log=lines.append,
    )
    assert any("mesh {'data': 8}" in line for line in lines), lines
    ref = train(TrainOptions(target="eager", **opts), log=lambda _: None)  # type: ignore[arg-type]
    assert all(math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-5) for a, b in zip(meshed.losses, ref.losses)), (
        meshed.losses,
        ref.losses,
    )
    # --recompute layers under the mesh: the rewritten step partitions and trains the same
    rlines: list[str] = []
    recomputed = train(
        TrainOptions(target="tpu", mesh="data=8", recompute="layers", **opts),  # type: ignore[arg-type]
        log=rlines.append,
    )
    assert any("--recompute layers: " in line and "mesh {'data': 8}" in line for line in rlines), rlines
    assert recomputed.losses == pytest.approx(meshed.losses, rel=1e-6, abs=1e-7)
    # --pipeline_sparse 2 under the mesh: the batch-only id work runs a batch ahead, the numbers stay
    plines: list[str] = []
    pipelined = train(
        TrainOptions(target="tpu", mesh="data=8", pipeline_sparse=2, **opts),  # type: ignore[arg-type]
        log=plines.append,
    )
    assert any("--pipeline_sparse 2: " in line for line in plines), plines
    assert pipelined.losses == pytest.approx(meshed.losses, rel=1e-6, abs=1e-7)
    assert pipelined.metrics == pytest.approx(meshed.metrics, rel=1e-5, abs=1e-6, nan_ok=True)
    # --table_dtype fp16 under the mesh, pipelined: GSPMD shards the fp16 tables, and the run trains as the
    # one-device fp16 run does (the same stochastic rounding bits)
    hlines: list[str] = []
    half = train(
        TrainOptions(target="tpu", mesh="data=8", pipeline_sparse=2, table_dtype="fp16", **opts),  # type: ignore[arg-type]
        log=hlines.append,
    )
    assert any("--table_dtype fp16: 3 table(s)" in line and "mesh {'data': 8}" in line for line in hlines), (
        hlines
    )
    one = train(TrainOptions(target="tpu", table_dtype="fp16", **opts), log=lambda _: None)  # type: ignore[arg-type]
    assert half.losses == pytest.approx(one.losses, rel=1e-5, abs=1e-6)
    assert half.losses != pytest.approx(meshed.losses, rel=1e-7, abs=0)  # the fp16 tables took effect
    # the TPU path's (global) checkpoint resumes on the GPU path's distributed program (1-rank group)
    try:
        resumed = train(
            TrainOptions(target="eager-graph", parallel="fsdp", resume=ckpt + "/step-2", **opts),  # type: ignore[arg-type]
            log=lambda _: None,
        )
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    assert resumed.start_step == 2
    assert math.isclose(resumed.losses[0], ref.losses[2], rel_tol=1e-3, abs_tol=1e-5)
