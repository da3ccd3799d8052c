"""A run's checkpoints (one process): CheckpointManager keeps the newest written, refuses, continues or
overwrites another run's, and `latest` always names a complete checkpoint; recir.json records slot shapes
and file checksums, so damaged files and checkpoints that do not fit are errors naming them."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import recir.distributed as rd
import torch


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"param:w": torch.full((2, 3), float(value)), "optim:step": torch.tensor(float(value))}


def _names(root: Path) -> list[str]:
    return [p.name for p in rd.list_checkpoints(root)]


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_checkpoint_manager_keeps_the_newest_written_checkpoints(tmp_path):
    manager = rd.CheckpointManager(tmp_path, keep=2)
    for step in (2, 4, 6):
        manager.save(step, _state(step), meta={"note": "first"})
    assert _names(tmp_path) == ["step-4", "step-6"] == [p.name for p in manager.checkpoints()]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-4", "step-6"]
    assert (tmp_path / "latest").read_text() == "step-6" and manager.latest() == tmp_path / "step-6"
    manifest = json.loads((tmp_path / "checkpoints.json").read_text())
    assert manifest["run_id"] == manager.run_id == rd.checkpoint_meta(tmp_path / "step-6")["run_id"]
    assert rd.checkpoint_meta(tmp_path / "step-6")["step"] == 6

    # Continuing the run from step 4 writes step 5: kept by write order, although 6 is the higher number.
    resumed = rd.CheckpointManager(tmp_path, keep=2, existing="continue")
    assert resumed.run_id == manager.run_id
    resumed.save(5, _state(5))
    assert _names(tmp_path) == ["step-6", "step-5"] and rd.latest_checkpoint(tmp_path) == tmp_path / "step-5"
    assert not (tmp_path / "step-4").exists()

    # Another run into the same directory: refused, and nothing is written or deleted ...
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    before = _snapshot(tmp_path)
    with pytest.raises(rd.ConfigError, match=r"holds the checkpoints of another run \(step-6, step-5\)"):
        rd.CheckpointManager(tmp_path)
    assert _snapshot(tmp_path) == before
    # ... or it deletes them first (and only them), and starts a new run id
    fresh = rd.CheckpointManager(tmp_path, keep=1, existing="overwrite")
    assert [p.name for p in fresh.removed] == ["step-6", "step-5"] and fresh.run_id != manager.run_id
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    fresh.save(1, _state(1))
    fresh.save(2, _state(2))
    assert _names(tmp_path) == ["step-2"]
    with pytest.raises(rd.ConfigError, match="keep must be >= 1"):
        rd.CheckpointManager(tmp_path, keep=0, existing="continue")
    with pytest.raises(rd.ConfigError, match="existing='again'"):
        rd.CheckpointManager(tmp_path, existing="again")


def test_latest_checkpoint_is_always_complete(tmp_path):
    manager = rd.CheckpointManager(tmp_path, keep=3)
    for step in (1, 2):
        manager.save(step, _state(step))
    # a crash while step-2 was being replaced (moved aside, the new copy not yet renamed in)
    os.rename(tmp_path / "step-2", tmp_path / ".old-step-2")
    assert (tmp_path / "latest").read_text() == "step-2"
    assert rd.latest_checkpoint(tmp_path) == tmp_path / "step-1"
    os.rename(tmp_path / ".old-step-2", tmp_path / "step-2")
    # a directory written before manifests: its checkpoints by step number
    os.remove(tmp_path / "checkpoints.json")
    os.remove(tmp_path / "latest")
    assert _names(tmp_path) == ["step-1", "step-2"] and rd.latest_checkpoint(tmp_path) == tmp_path / "step-2"
    (tmp_path / "checkpoints.json").write_text('{"checkpoints": ')
    with pytest.raises(rd.DataError, match=r"checkpoints.json: damaged .* Fix: delete it"):
        rd.list_checkpoints(tmp_path)
    assert rd.latest_checkpoint(tmp_path / "nothing") is None


def test_checkpoint_checksums_find_damaged_files(tmp_path):
    directory = tmp_path / "c"
    rd.save_sharded(directory, {**_state(3), "buffer:ids": torch.arange(4)}, None, meta={"step": 3})
    meta = rd.verify_checkpoint(directory)
    assert meta["slots"]["buffer:ids"] == {"shape": [4], "dtype": "int64"} and meta["step"] == 3
    assert rd.saved_slots(directory) == {
        "param:w": ((2, 3), "float32"),
        "optim:step": ((), "float32"),
        "buffer:ids": ((4,), "int64"),
    }
    distcp = next(directory.glob("*.distcp"))
    assert set(meta["files"]) == {distcp.name, ".metadata", "plan.json"}
    data = distcp.read_bytes()
    distcp.write_bytes(data[:-10])
    with pytest.raises(
        rd.DataError, match=rf"{distcp}: damaged \({len(data) - 10} bytes, {len(data)} when written\)"
    ):
        rd.load_resharded(directory, None)
    with pytest.raises(rd.DataError, match=r"unreadable .distcp data \(\w+"):  # unverified: still one line
        rd.load_resharded(directory, None, verify=False)
    distcp.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(rd.DataError, match="its sha256 differs"):
        rd.verify_checkpoint(directory)
    distcp.write_bytes(data)
    assert torch.equal(rd.load_resharded(directory, None)["buffer:ids"], torch.arange(4))

    meta_file = directory / "recir.json"
    text = meta_file.read_text()
    meta_file.write_text(text[:-5])
    with pytest.raises(rd.DataError, match=r"recir.json: damaged \(not valid JSON"):
        rd.load_resharded(directory, None)
    meta_file.write_text(text.replace('"step": 3', '"step": 4'))
    with pytest.raises(rd.DataError, match="do not match the checksum"):
        rd.checkpoint_meta(directory)
    with pytest.raises(rd.ConfigError, match=r"meta keys \['slots'\] are reserved"):
        rd.save_sharded(tmp_path / "d", _state(1), None, meta={"slots": 1})


def test_compare_slots_names_every_difference():
    saved = {"a": ((2,), "float32"), "b": ((3,), "float32"), "rng:x": ((5,), "uint8")}
    wanted = {"a": ((2,), "float64"), "b": ((4,), "float32"), "c": ((1,), "float32")}
    assert [str(p) for p in rd.compare_slots(saved, wanted)] == [
        "slot a: dtype float32 in the checkpoint, float64 in this run",
        "slot b: shape [3] in the checkpoint, [4] in this run",
        "slot c: this run has it, the checkpoint does not (it would start fresh)",
        "slot rng:x: the checkpoint has it, this run does not (it would be dropped)",
    ]
    allowed = rd.compare_slots(saved, wanted, allow_fresh=["rng:*", "c"])
    assert [(p.slot, p.kind) for p in allowed] == [("a", "dtype"), ("b", "shape")]
    assert rd.compare_slots(saved, saved) == []
