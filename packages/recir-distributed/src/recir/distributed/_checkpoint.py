"""Sharded checkpoints through torch.distributed.checkpoint (DCP): each rank writes only its shards, the
plan is saved beside them, and ``load_resharded`` reads them back under any plan or world size (or whole).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from recir.transforms import ConfigError, DataError
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ._plan import ShardingPlan, shard_range

PLAN_FILE = "plan.json"
META_FILE = "recir.json"  # written last: a directory holding it is a complete checkpoint
_SEP = "#shard"


def _dist() -> tuple[bool, int, int]:
    import torch.distributed as dist

    on = dist.is_available() and dist.is_initialized()
    return on, (dist.get_rank() if on else 0), (dist.get_world_size() if on else 1)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_shard(sh: Mapping[str, Any]) -> bool:
    return sh.get("placement") == "shard"


def save_sharded(
    directory: str | Path,
    state: Mapping[str, torch.Tensor],
    plan: ShardingPlan | None,
    rank: int | None = None,
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Write this rank's ``{slot: local tensor}`` (its shards under ``plan``; ``None``: global tensors)
    to ``directory``, atomically: every rank writes into ``.tmp-<name>``, then rank 0 (after a barrier)
    adds ``plan.json`` and ``recir.json`` (``meta``) and renames it. Call on every rank.
    """
    on, my_rank, world = _dist()
    rank = my_rank if rank is None else rank
    if plan is not None and plan.world_size != world:
        raise ConfigError(
            f"save_sharded: the plan is for {plan.world_size} devices, but {world} process(es) are saving. "
            "Fix: save under the plan this world trains with (or pass plan=None with global tensors)."
        )
    final = Path(directory)
    tmp = final.parent / f".tmp-{final.name}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        sh = plan.slots.get(name, {}) if plan is not None else {}
        t = torch.as_tensor(t).detach().cpu().contiguous()
        if not _is_shard(sh):
            tensors[name] = t  # replicated: every rank passes it, DCP writes it once
        elif sh.get("scheme") != "table_wise" or sh["owner"] == rank:
            tensors[f"{name}{_SEP}{rank}"] = t
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when no process group is initialised: intended
        # per_thread_copy_ahead=0: DCP's overlapping copier asks the privateuse1 device module for
        # streams, and torchax (imported by the TPU path) registers one without them.
        dcp.save(tensors, storage_writer=FileSystemWriter(str(tmp), per_thread_copy_ahead=0))
    _barrier()
    if rank == 0:
        (tmp / PLAN_FILE).write_text(json.dumps(plan.to_dict() if plan is not None else None, indent=1))
        (tmp / META_FILE).write_text(json.dumps({**dict(meta or {}), "world_size": world}))
        old = final.parent / f".old-{final.name}"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def saved_plan(directory: str | Path) -> ShardingPlan | None:
    """The plan a checkpoint was saved under (``None``: it holds global tensors)."""
    path = Path(directory) / PLAN_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return None if data is None else ShardingPlan.from_dict(data)


def load_resharded(
    directory: str | Path,
    plan: ShardingPlan | None,
    rank: int | None = None,
    slots: Iterable[str] | None = None,
    *,
    strict: bool = True,
) -> dict[str, torch.Tensor]:
    """This rank's ``{slot: tensor}`` under ``plan`` (``None``: global tensors) from a checkpoint saved
    under any plan and world size. ``slots`` (default: the plan's slots, or all saved) picks slots; with
    ``strict`` a wanted slot missing from the checkpoint is a ``DataError``. Reads files only (no collective).
    """
    root = Path(directory)
    if not (root / META_FILE).is_file():
        raise DataError(f"{root}: not a complete checkpoint (no {META_FILE}); the save did not finish")
    rank = _dist()[1] if rank is None else rank
    old = saved_plan(root)
    md = FileSystemReader(str(root)).read_metadata().state_dict_metadata
    pieces: dict[str, dict[int, str]] = {}
    for key, item in md.items():
        if getattr(item, "size", None) is None:
            continue
        name, _, r = key.partition(_SEP)
        pieces.setdefault(name, {})[int(r) if r else -1] = key
    wanted = list(slots) if slots is not None else list(plan.slots) if plan is not None else list(pieces)
    missing = [s for s in wanted if s not in pieces]
    if missing and strict:
        raise DataError(
            f"{root}: the checkpoint has no slot(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            f"(it holds {len(pieces)} slots). Fix: load with the model/optimizers it was saved from, "
            "or pass strict=False to keep those slots' fresh values."
        )
    wanted = [s for s in wanted if s in pieces]
    buffers = {
        key: torch.empty(md[key].size, dtype=md[key].properties.dtype)  # type: ignore[union-attr]
        for s in wanted
        for key in pieces[s].values()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(buffers, storage_reader=FileSystemReader(str(root)), no_dist=True)
    out: dict[str, torch.Tensor] = {}
    for s in wanted:
        full = _assemble(s, pieces[s], buffers, old)
        if plan is not None and s in plan.shapes and tuple(plan.shapes[s]) != tuple(full.shape):
            raise DataError(
                f"{root}: slot {s!r} has global shape {list(full.shape)} in the checkpoint, the plan expects "
                f"{list(plan.shapes[s])}. Fix: build the model with the sizes the checkpoint was trained with."
            )
        sh = plan.slots.get(s, {}) if plan is not None else {}
        if _is_shard(sh):
            dim, start, stop = shard_range(tuple(full.shape), sh, rank)
            full = full.narrow(dim, start, stop - start).clone()
        out[s] = full
    return out


def _assemble(
    slot: str, keys: Mapping[int, str], buffers: Mapping[str, torch.Tensor], old: ShardingPlan | None
) -> torch.Tensor:
    """The global value of ``slot`` from its saved pieces (whole, one owner's table, or rank-ordered blocks)."""
    if -1 in keys:
        return buffers[keys[-1]]
    sh = old.slots.get(slot, {}) if old is not None else {}
    if sh.get("scheme") == "table_wise" or len(keys) == 1:
        return buffers[next(iter(keys.values()))]
    return torch.cat([buffers[keys[r]] for r in sorted(keys)], dim=int(sh.get("dim", 0)))
