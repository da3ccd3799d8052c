"""Sharded DCP checkpoints: saved by 2 gloo ranks under one plan, loaded by the same 2 ranks under another
mode and by one process with no plan; training continues and matches one process on the global batch
(parameters, optimizer state, losses), and by 4 ranks under another plan.
"""

from __future__ import annotations

import math

import pytest
import recir.distributed as rd
import torch
from _distributed_ckpt_workers import LOCAL_B, load_on_four, reference, save_then_reshard
from _distributed_workers import spawn


def test_checkpoint_saved_by_two_ranks_reshards(tmp_path):
    import _distributed_models as M

    directory = tmp_path / "ckpt"
    fsdp_rows = rd.HybridParallel(tables=rd.row_wise(), dense=rd.FullyShardedDataParallel())
    spawn(save_then_reshard, 2, str(directory), fsdp_rows, "table_wise")
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".old-*"))
    saved = rd.saved_plan(directory)
    assert saved is not None and saved.world_size == 2 and saved.mode != "table_wise"
    # recir.json records the global shapes (not rank 0's shards) and the checksums of both ranks' files
    assert rd.saved_slots(directory) == {n: (tuple(saved.shapes[n]), saved.dtypes[n]) for n in saved.slots}
    assert len([f for f in rd.verify_checkpoint(directory)["files"] if f.endswith(".distcp")]) == 2
    # the same files, read by one process as global tensors: continue on the global batch
    ref_losses, half, ref_final = reference(2, 6)
    gstep = M.emb_step(LOCAL_B * 2)
    loaded = rd.load_resharded(directory, None)
    for name, want in half.items():
        assert torch.allclose(loaded[name], want, atol=2e-5, rtol=1e-4), name
    state = gstep.load_state_dict(loaded)
    for k in range(3, 6):
        gb = M.concat_batches([M.emb_batch(LOCAL_B, k, seed=1 + r) for r in range(2)])
        state, out = gstep(state, gb)
        assert math.isclose(float(out[0]), ref_losses[k], rel_tol=1e-4, abs_tol=1e-5)
    for name, want in gstep.state_dict(state).items():
        assert torch.allclose(want, ref_final[name], atol=2e-5, rtol=1e-4), name
    # and by 4 ranks under row-wise tables + FSDP dense (each rank's block of the saved global state)
    spawn(load_on_four, 4, str(directory))


def test_checkpoint_errors(tmp_path):
    import _distributed_models as M

    step = M.emb_step(4)
    plan1 = rd.plan(step, "data_parallel", rd.Mesh(axes={"data": 1}))
    rd.save_sharded(tmp_path / "c", {"param:w": torch.ones(2)}, None)
    with pytest.raises(rd.DataError, match="no slot"):
        rd.load_resharded(tmp_path / "c", plan1)
    with pytest.raises(rd.DataError, match="no slot"):  # only the named slots may stay fresh
        rd.load_resharded(tmp_path / "c", plan1, allow_missing=["param:*"])
    assert set(rd.load_resharded(tmp_path / "c", plan1, allow_missing=["*"])) == set()
    with pytest.raises(rd.DataError, match="not a complete checkpoint"):
        rd.load_resharded(tmp_path, None)
    with pytest.raises(rd.ConfigError, match="2 devices"):
        rd.save_sharded(tmp_path / "d", {}, rd.plan(step, "data_parallel", rd.Mesh(axes={"data": 2})))
