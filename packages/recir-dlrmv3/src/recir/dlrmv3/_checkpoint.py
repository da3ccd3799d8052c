"""DLRMv3 checkpoints: `<dir>/step-N` written by recir.distributed's CheckpointManager (atomic, sharded
DCP files with per-file sha256, the newest `keep` of this run by write order, `<dir>/latest`), and read
back, verified, under any plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from recir.distributed import CheckpointManager, load_resharded, verify_checkpoint
from recir.distributed import latest_checkpoint as latest_checkpoint  # the newest complete one, or None
from recir.transforms import DataError

KEEP = 2
_META = "recir.json"


def save_checkpoint(
    directory: str | Path,
    step: int,
    state: Mapping[str, torch.Tensor],
    meta: dict[str, Any],
    plan: Any = None,
    *,
    keep: int = KEEP,
) -> Path:
    """Writes `state` (this rank's shards under `plan`, or global tensors) plus JSON `meta` as checkpoint
    `step` of the run in `directory` and keeps its newest `keep` by write order. Call on every rank.
    (A training loop holds one `recir.distributed.CheckpointManager` instead.)"""
    return CheckpointManager(directory, keep=keep, existing="continue").save(step, state, plan, meta)


def resolve_checkpoint(path: str | Path) -> Path:
    """`path` itself when it is a complete checkpoint, else the latest one in the directory `path`."""
    path = Path(path)
    if (path / _META).is_file():
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise DataError(f"{path}: no complete checkpoint found (expected {path}/step-N/{_META})")
    return found


def load_checkpoint(
    path: str | Path, plan: Any = None, *, allow_fresh: Iterable[str] = ()
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state, meta) of the checkpoint at `path` (a `step-N` directory or a checkpoint root): this rank's
    shards under `plan` (None: every saved slot as a global tensor), whatever plan and world size saved it.
    Every file is checked against its sha256 first. A slot `plan` needs that the checkpoint lacks is a
    `DataError` unless its name matches an `allow_fresh` glob pattern."""
    path = resolve_checkpoint(path)
    meta = verify_checkpoint(path)
    return load_resharded(path, plan, allow_missing=allow_fresh, verify=False), meta
