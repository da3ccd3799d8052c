"""`train --parallel` on 2 gloo processes (the captured step's per-rank program, run by the StepGraph
interpreter: `--target eager-graph`) matches one eager process step for step; its sharded checkpoint
resumes on one eager process; the TPU path's `--mesh data=8` matches too; bad meshes/batches are errors.
"""

from __future__ import annotations

import json
import math
import socket

import pytest
import torch.multiprocessing as mp
from _dlrmv3_workers import SMALL, run_rank
from recir.dlrmv3 import TrainOptions, train
from recir.dlrmv3._cli import main
from recir.transforms import ConfigError


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dlrmv3_two_ranks_train_like_one_and_resume_on_one(tmp_path):
    mp.spawn(run_rank, args=(2, _port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[1]["lines"] == []  # logs from rank 0 only
    assert any("2 rank(s), parallel hybrid" in line for line in ranks[0]["lines"])
    ref = train(TrainOptions(target="eager", **SMALL), log=lambda _: None)  # type: ignore[arg-type]
    for r in ranks:
        assert all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) for a, b in zip(r["losses"], ref.losses)), (
            r["losses"],
            ref.losses,
        )
    # the checkpoint holds each rank's shards and the plan; one eager process resumes from step 2
    step2 = tmp_path / "ckpt" / "step-2"
    assert (step2 / "plan.json").is_file() and len(list(step2.glob("*.distcp"))) == 2
    resumed = train(
        TrainOptions(target="eager", resume=str(step2), **SMALL),  # type: ignore[arg-type]
        log=lambda _: None,
    )
    assert resumed.start_step == 2
    assert all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) for a, b in zip(resumed.losses, ref.losses[2:]))


def test_dlrmv3_parallel_errors(capsys):
    from recir.dlrmv3._parallel import check_batch_split, parse_mesh

    with pytest.raises(ConfigError, match="does not split over the data-parallel size 2"):
        check_batch_split(7, 2)
    with pytest.raises(ConfigError, match="NAME=SIZE"):
        parse_mesh("data8")
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
