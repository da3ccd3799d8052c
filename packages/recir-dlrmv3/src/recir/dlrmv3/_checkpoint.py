"""Atomic torch.distributed.checkpoint (DCP) checkpoints of a flat `name -> tensor` training state.

A checkpoint is written to `<dir>/.tmp-step-N`, then renamed to `<dir>/step-N`, then `<dir>/latest`
is replaced atomically; a crash at any point leaves the previous checkpoint intact and named.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from recir.transforms import DataError
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

KEEP = 2
_META = "recir.json"


def save_checkpoint(
    directory: str | Path, step: int, state: Mapping[str, torch.Tensor], meta: dict[str, Any]
) -> Path:
    """Writes `state` (plus JSON `meta`) as checkpoint `step`; keeps the newest `KEEP` checkpoints."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is initialised: intended
        # per_thread_copy_ahead=0: DCP's overlapping loader would ask the privateuse1 device module for
        # streams, and torchax (imported by the TPU path) registers one without them.
        dcp.save(tensors, storage_writer=FileSystemWriter(str(tmp), per_thread_copy_ahead=0))
    (tmp / _META).write_text(json.dumps({"step": step, **meta}))
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    pointer = root / ".latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    for old in sorted(root.glob("step-*"), key=_step_of)[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _step_of(path: Path) -> int:
    try:
        return int(path.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under `directory`, or None."""
    root = Path(directory)
    pointer = root / "latest"
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        if (path / _META).is_file():
            return path
    done = [p for p in root.glob("step-*") if (p / _META).is_file()]
    return max(done, key=_step_of) if done else None


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state, meta) of the checkpoint at `path` (a `step-N` directory or a checkpoint root)."""
    path = Path(path)
    if not (path / _META).is_file():
        found = latest_checkpoint(path) if path.is_dir() else None
        if found is None:
            raise DataError(f"{path}: no complete checkpoint found (expected {path}/step-N/{_META})")
        path = found
    meta = json.loads((path / _META).read_text())
    md = FileSystemReader(str(path)).read_metadata()
    state: dict[str, torch.Tensor] = {}
    for key, item in md.state_dict_metadata.items():
        size = getattr(item, "size", None)
        if size is None:
            continue
        state[key] = torch.empty(size, dtype=item.properties.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path))
    return state, meta
