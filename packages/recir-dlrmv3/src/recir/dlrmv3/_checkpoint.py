"""Atomic, sharded torch.distributed.checkpoint (DCP) checkpoints of a flat `name -> tensor` state.

Every rank writes its shards to `<dir>/.tmp-step-N` (recir.distributed.save_sharded, plan beside them),
rank 0 renames it to `<dir>/step-N` and replaces `<dir>/latest`; a crash leaves the previous one usable.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from recir.transforms import DataError

KEEP = 2
_META = "recir.json"


def save_checkpoint(
    directory: str | Path,
    step: int,
    state: Mapping[str, torch.Tensor],
    meta: dict[str, Any],
    plan: Any = None,
) -> Path:
    """Writes `state` (this rank's shards under `plan`, or global tensors) plus JSON `meta` as checkpoint
    `step` through recir.distributed.save_sharded; keeps the newest `KEEP`. Call on every rank."""
    from recir.distributed import save_sharded

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = save_sharded(root / f"step-{step}", state, plan, meta={"step": step, **meta})
    if _rank() == 0:
        pointer = root / ".latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, root / "latest")
        for old in sorted(root.glob("step-*"), key=_step_of)[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


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


def load_checkpoint(path: str | Path, plan: Any = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state, meta) of the checkpoint at `path` (a `step-N` directory or a checkpoint root): this rank's
    shards under `plan` (None: global tensors), whatever plan and world size saved it."""
    from recir.distributed import load_resharded

    path = Path(path)
    if not (path / _META).is_file():
        found = latest_checkpoint(path) if path.is_dir() else None
        if found is None:
            raise DataError(f"{path}: no complete checkpoint found (expected {path}/step-N/{_META})")
        path = found
    meta = json.loads((path / _META).read_text())
    return load_resharded(path, plan, strict=False), meta
