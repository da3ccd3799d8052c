"""Keep-k checkpoints of one run in a directory, with Orbax ``CheckpointManager`` semantics: a manifest
lists the run's checkpoints in write order, ``latest`` names the newest, and rotation deletes only
checkpoints the manifest lists, after the new one is complete. Another run's checkpoints are refused,
continued or removed, as the caller says.

    <dir>/step-N/         one checkpoint (save_sharded: DCP files, plan.json, recir.json last)
    <dir>/checkpoints.json {"run_id": ..., "checkpoints": ["step-3", "step-6"]}, oldest written first
    <dir>/latest          "step-6"
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from recir.transforms import ConfigError, DataError

from ._checkpoint import META_FILE, _barrier, _dist, save_sharded
from ._plan import ShardingPlan

MANIFEST_FILE = "checkpoints.json"
LATEST_FILE = "latest"
EXISTING = ("refuse", "continue", "overwrite")


def _step_of(name: str) -> int:
    try:
        return int(name.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def _read_manifest(root: Path) -> dict[str, Any] | None:
    path = root / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not all(isinstance(n, str) for n in data["checkpoints"]):
            raise ValueError("not a manifest")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise DataError(
            f"{path}: damaged ({e}). Fix: delete it; each checkpoint's own {META_FILE} is intact, and "
            "without a manifest the checkpoints are found by step number."
        ) from None
    return data


def list_checkpoints(directory: str | Path) -> list[Path]:
    """The complete checkpoints of the run in ``directory``, oldest written first: the manifest's, or, in
    a directory written before manifests existed, every ``step-N`` by step number."""
    root = Path(directory)
    manifest = _read_manifest(root)
    if manifest is not None:
        names = list(manifest["checkpoints"])
    else:
        names = sorted((p.name for p in root.glob("step-*") if p.is_dir()), key=_step_of)
    return [root / n for n in names if (root / n / META_FILE).is_file()]


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in ``directory`` (what ``latest`` names, or the manifest's newest
    complete one when a crash left ``latest`` naming one that is being replaced), or ``None``."""
    root = Path(directory)
    pointer = root / LATEST_FILE
    name = pointer.read_text().strip() if pointer.is_file() else ""
    if name and (root / name / META_FILE).is_file():
        return root / name
    done = list_checkpoints(root)
    return done[-1] if done else None


def write_atomically(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Readers see the old contents or the new, never a torn file (write a temporary beside it, fsync,
    rename). Creates the parent directory. Checkpoint manifests and exported artifacts use it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with tmp.open("wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # after a failure; after the rename there is nothing left to remove


def _remove_checkpoints(root: Path) -> list[Path]:
    """Deletes every checkpoint artefact in ``root`` (step dirs, temporaries, manifest, pointer) and
    nothing else; returns the complete checkpoints it removed."""
    removed = list_checkpoints(root)
    for pattern in ("step-*", ".tmp-step-*", ".old-step-*"):
        for p in root.glob(pattern):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
    for name in (MANIFEST_FILE, LATEST_FILE, f".{MANIFEST_FILE}.tmp", f".{LATEST_FILE}.tmp"):
        (root / name).unlink(missing_ok=True)
    return removed


class CheckpointManager:
    """Saves ``step-N`` checkpoints of one run into ``directory`` and keeps the newest ``keep`` of them
    by write order (a resumed run that rewrites lower steps keeps those, not the highest numbers).

    ``existing`` says what to do when ``directory`` already holds checkpoints: ``"refuse"`` raises
    ``ConfigError`` (nothing written or deleted), ``"continue"`` adopts them as this run's (a resume),
    ``"overwrite"`` deletes them first (``removed`` lists them). Create and ``save`` on every rank of a
    process group: rank 0 deletes, writes the manifest and ``latest``; the others wait at barriers.
    """

    def __init__(self, directory: str | Path, *, keep: int = 2, existing: str = "refuse") -> None:
        if keep < 1:
            raise ConfigError(f"CheckpointManager: keep must be >= 1, got {keep}")
        if existing not in EXISTING:
            raise ConfigError(
                f"CheckpointManager: existing={existing!r}; expected one of {', '.join(EXISTING)}"
            )
        self.directory, self.keep = Path(directory), keep
        found = list_checkpoints(self.directory)
        manifest = _read_manifest(self.directory)
        self.removed: list[Path] = []
        if found and existing == "refuse":
            raise ConfigError(
                f"{self.directory} holds the checkpoints of another run ({', '.join(p.name for p in found)}). "
                "Fix: continue that run (existing='continue'), delete them first (existing='overwrite'), "
                "or save into another directory."
            )
        if existing == "overwrite":
            self.removed = found
            if _dist()[1] == 0:
                _remove_checkpoints(self.directory)
            _barrier()
            found, manifest = [], None
        self.run_id: str = manifest["run_id"] if manifest and manifest.get("run_id") else uuid.uuid4().hex
        self._names = [p.name for p in found]

    def checkpoints(self) -> list[Path]:
        """This run's checkpoints, oldest written first."""
        return [self.directory / n for n in self._names]

    def latest(self) -> Path | None:
        return latest_checkpoint(self.directory)

    def save(
        self,
        step: int,
        state: Mapping[str, torch.Tensor],
        plan: ShardingPlan | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Path:
        """Writes ``step-<step>`` (``save_sharded``; ``meta`` plus ``step`` and ``run_id``), then records
        it in the manifest, points ``latest`` at it and deletes this run's checkpoints beyond ``keep``, in
        that order: a crash at any point leaves ``latest`` or the manifest naming a complete checkpoint.
        """
        name = f"step-{step}"
        path = save_sharded(
            self.directory / name, state, plan, meta={**dict(meta or {}), "step": step, "run_id": self.run_id}
        )
        names = [n for n in self._names if n != name] + [name]
        kept, dropped = names[-self.keep :], names[: -self.keep]
        if _dist()[1] == 0:
            body = {"format": 1, "run_id": self.run_id, "checkpoints": kept}
            write_atomically(self.directory / MANIFEST_FILE, json.dumps(body, indent=1))
            write_atomically(self.directory / LATEST_FILE, name)
            for old in dropped:
                shutil.rmtree(self.directory / old, ignore_errors=True)
        self._names = kept
        _barrier()
        return path
