"""Sharded checkpoints through torch.distributed.checkpoint (DCP): each rank writes only its shards, the
plan is saved beside them, and ``load_resharded`` reads them back under any plan or world size (or whole).
``recir.json`` records every slot's global shape and dtype and every file's size and sha256, so a load
finds a damaged file (and ``compare_slots`` a checkpoint that does not fit) before any state changes.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from recir.transforms import ConfigError, DataError
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from ._plan import ShardingPlan, shard_range

PLAN_FILE = "plan.json"
META_FILE = "recir.json"  # written last: a directory holding it is a complete checkpoint
FORMAT = 2  # recir.json with "slots", "files" and its own "checksum" (1: meta and world size only)
_RESERVED = ("format", "world_size", "slots", "files", "checksum")
_SEP = "#shard"

# A slot's global (shape, dtype name), e.g. ((1000, 64), "float32"): what recir.json records per slot.
SlotSpec = tuple[tuple[int, ...], str]


class CheckpointMismatchError(ConfigError):
    """A checkpoint does not fit the run loading it; ``problems`` holds one line per difference."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(self.problems))


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
    adds ``plan.json`` and ``recir.json`` (``meta``, the world size, every slot's global shape and dtype,
    every file's size and sha256) and renames it. Call on every rank.
    """
    on, my_rank, world = _dist()
    rank = my_rank if rank is None else rank
    if plan is not None and plan.world_size != world:
        raise ConfigError(
            f"save_sharded: the plan is for {plan.world_size} devices, but {world} process(es) are saving. "
            "Fix: save under the plan this world trains with (or pass plan=None with global tensors)."
        )
    clash = sorted(set(meta or {}) & set(_RESERVED))
    if clash:
        raise ConfigError(f"save_sharded: meta keys {clash} are reserved for recir.json. Fix: rename them.")
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
        # The checksums cover every rank's files: rank 0 reads them all (the directory is shared, as the
        # rename below already assumes).
        files = {
            p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(tmp.iterdir())
            if p.is_file() and p.name != META_FILE
        }
        body: dict[str, Any] = {**dict(meta or {}), "format": FORMAT, "world_size": world}
        body["slots"] = {k: {"shape": list(v[0]), "dtype": v[1]} for k, v in slot_specs(state, plan).items()}
        body["files"] = files
        body["checksum"] = _meta_checksum(body)
        _write_synced(tmp / META_FILE, json.dumps(body, indent=1))
        old = final.parent / f".old-{final.name}"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def slot_specs(state: Mapping[str, Any], plan: ShardingPlan | None = None) -> dict[str, SlotSpec]:
    """``{slot: (global shape, dtype name)}`` of a state mapping (this rank's shards under ``plan``, which
    knows the global shapes; ``None``: global tensors)."""
    out: dict[str, SlotSpec] = {}
    for name, t in state.items():
        t = torch.as_tensor(t)
        shape = plan.shapes[name] if plan is not None and name in plan.shapes else t.shape
        out[name] = (tuple(int(d) for d in shape), _dtype_name(t.dtype))
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class SlotProblem:
    """One way a checkpoint's slot differs from the slot a run needs (``kind``: ``missing`` from the
    checkpoint, ``extra`` in it, ``shape`` or ``dtype``); ``str()`` is a readable line."""

    slot: str
    kind: str
    checkpoint: Any = None
    run: Any = None

    def __str__(self) -> str:
        if self.kind == "missing":
            return f"slot {self.slot}: this run has it, the checkpoint does not (it would start fresh)"
        if self.kind == "extra":
            return f"slot {self.slot}: the checkpoint has it, this run does not (it would be dropped)"
        return f"slot {self.slot}: {self.kind} {self.checkpoint} in the checkpoint, {self.run} in this run"


def compare_slots(
    saved: Mapping[str, SlotSpec], wanted: Mapping[str, SlotSpec], allow_fresh: Iterable[str] = ()
) -> list[SlotProblem]:
    """Every difference between a checkpoint's slots and the slots a run needs, by slot name: missing
    from the checkpoint (the run would keep a fresh value), extra (it would be dropped), another shape
    or dtype. Slots whose name matches an ``allow_fresh`` glob pattern may be missing or extra."""
    patterns = list(allow_fresh)
    problems = []
    for name in sorted(set(saved) | set(wanted)):
        if name not in saved or name not in wanted:
            if not any(fnmatch.fnmatchcase(name, p) for p in patterns):
                problems.append(SlotProblem(name, "missing" if name not in saved else "extra"))
            continue
        (s_shape, s_dtype), (w_shape, w_dtype) = saved[name], wanted[name]
        if tuple(s_shape) != tuple(w_shape):
            problems.append(SlotProblem(name, "shape", list(s_shape), list(w_shape)))
        if s_dtype != w_dtype:
            problems.append(SlotProblem(name, "dtype", s_dtype, w_dtype))
    return problems


def checkpoint_meta(directory: str | Path) -> dict[str, Any]:
    """The checked contents of ``directory``'s ``recir.json``: ``DataError`` naming the file when the
    checkpoint is incomplete or the file is not valid JSON or does not match its own checksum."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise DataError(f"{path.parent}: not a complete checkpoint (no {META_FILE}); the save did not finish")
    try:
        meta = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: damaged (not valid JSON: {e})") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path}: damaged (a JSON {type(meta).__name__}, expected an object)")
    legacy = not any(k in meta for k in ("format", "slots", "files", "checksum"))  # written before format 2
    if not legacy and meta.get("checksum") != _meta_checksum(meta):
        raise DataError(f"{path}: damaged (its contents do not match the checksum written with them)")
    return meta


def verify_checkpoint(directory: str | Path) -> dict[str, Any]:
    """``checkpoint_meta`` plus every file's size and sha256 against the values written at save time;
    ``DataError`` naming the first damaged or missing file. Returns the metadata."""
    root = Path(directory)
    meta = checkpoint_meta(root)
    for name, want in (meta.get("files") or {}).items():
        path = root / name
        if not path.is_file():
            raise DataError(f"{path}: missing (the checkpoint was written with it)")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise DataError(f"{path}: damaged ({size} bytes, {want['bytes']} when written)")
        if _sha256(path) != want["sha256"]:
            raise DataError(f"{path}: damaged (its sha256 differs from the one written with it)")
    return meta


def saved_slots(directory: str | Path) -> dict[str, SlotSpec] | None:
    """The global shape and dtype of every slot a checkpoint holds (``None``: written before they were
    recorded)."""
    slots = checkpoint_meta(directory).get("slots")
    if slots is None:
        return None
    return {k: (tuple(v["shape"]), v["dtype"]) for k, v in slots.items()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _meta_checksum(meta: Mapping[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _brief(e: BaseException) -> str:
    """An exception as one short line: DCP's CheckpointException (a BaseException) wraps each rank's
    error with its whole traceback; name the first rank's error instead."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:200]}"


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


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
    allow_missing: Iterable[str] = (),
    verify: bool = True,
) -> dict[str, torch.Tensor]:
    """This rank's ``{slot: tensor}`` under ``plan`` (``None``: global tensors) from a checkpoint saved
    under any plan and world size. ``slots`` (default: the plan's slots, or all saved) picks slots; a
    wanted slot missing from the checkpoint is a ``DataError`` unless its name matches an
    ``allow_missing`` glob pattern (it is then left out: the caller keeps a fresh value on purpose).
    ``verify`` first checks every file against the sizes and sha256s written with it
    (``verify_checkpoint``). Reads files only (no collective).
    """
    root = Path(directory)
    if verify:
        verify_checkpoint(root)
    else:
        checkpoint_meta(root)
    rank = _dist()[1] if rank is None else rank
    old = saved_plan(root)
    try:
        md = FileSystemReader(str(root)).read_metadata().state_dict_metadata
    except (Exception, CheckpointException) as e:  # whatever DCP's unpickler hit on a damaged .metadata
        raise DataError(f"{root}/.metadata: unreadable ({_brief(e)})") from None
    pieces: dict[str, dict[int, str]] = {}
    for key, item in md.items():
        if getattr(item, "size", None) is None:
            continue
        name, _, r = key.partition(_SEP)
        pieces.setdefault(name, {})[int(r) if r else -1] = key
    wanted = list(slots) if slots is not None else list(plan.slots) if plan is not None else list(pieces)
    patterns = list(allow_missing)
    missing = [s for s in wanted if s not in pieces and not any(fnmatch.fnmatchcase(s, p) for p in patterns)]
    if missing:
        raise DataError(
            f"{root}: the checkpoint has no slot(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            f"(it holds {len(pieces)} slots). Fix: load with the model/optimizers it was saved from, "
            "or name the slots that may keep fresh values in allow_missing."
        )
    wanted = [s for s in wanted if s in pieces]
    buffers = {
        key: torch.empty(md[key].size, dtype=md[key].properties.dtype)  # type: ignore[union-attr]
        for s in wanted
        for key in pieces[s].values()
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(buffers, storage_reader=FileSystemReader(str(root)), no_dist=True)
    except (Exception, CheckpointException) as e:  # a truncated or damaged .distcp file (EOFError, ...)
        raise DataError(f"{root}: unreadable .distcp data ({_brief(e)})") from None
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
