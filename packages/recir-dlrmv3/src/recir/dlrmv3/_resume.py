"""Which checkpoint a `train` run writes and continues, checked before anything is loaded or written:
a --checkpoint_dir holding another run's checkpoints is refused unless --resume or --overwrite says what
to do; a resumed checkpoint must match its checksums, the run's configuration and every slot's shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from recir.capture import shared_step_layout, with_shared_step
from recir.transforms import STEP_SLOT, ConfigError, DataError, optim_slot, parse_slot_name

from ._checkpoint import resolve_checkpoint
from ._options import TrainOptions
from ._trainers import EagerTrainer, Trainer

# The TrainOptions a resumed run must share with its checkpoint: they set state shapes (sizes, tables,
# optimizer), state values (the captured step keeps the learning rates as slots) or which samples a step
# reads (dataset, seed, batch size). Target, plan and world size may change: checkpoints reshard.
RESUME_FIELDS = (
    "dataset",
    "seed",
    "batch_size",
    "embedding_dim",
    "num_layers",
    "num_heads",
    "uih_len",
    "num_candidates",
    "hash_size",
    "input_dropout",
    "layer_dropout",
    "optimizer",
    "lr",
    "sparse_lr",
)


def run_config(opts: TrainOptions) -> dict[str, Any]:
    """The configuration a checkpoint records and a resume compares: RESUME_FIELDS, plus ModelConfig's
    sizes that have no flag (as `model.<name>`), with `auto` (an older default) read as `reference`."""
    config: dict[str, Any] = {k: getattr(opts, k) for k in RESUME_FIELDS}
    if config["optimizer"] == "auto":
        config["optimizer"] = "reference"
    for key, value in dataclasses.asdict(opts.model_config()).items():
        if key not in config:
            config[f"model.{key}"] = value
    return config


def checkpoint_meta(opts: TrainOptions, parallel: str) -> dict[str, Any]:
    """What `train` writes into each checkpoint's recir.json beside the library's fields."""
    return {
        "dataset": opts.dataset,
        "target": opts.target,
        "seed": opts.seed,
        "parallel": parallel,
        "config": run_config(opts),
        "options": dataclasses.asdict(opts),  # for the record; not compared
    }


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def check_checkpoint_dir(opts: TrainOptions) -> None:
    """Refuses a --checkpoint_dir that holds checkpoints this run would rotate away or mix with its own,
    unless --resume continues them or --overwrite deletes them. Reads only."""
    from recir.distributed import list_checkpoints

    if not opts.checkpoint_dir or not opts.checkpoint_every or opts.overwrite:
        return
    root = Path(opts.checkpoint_dir)
    found = list_checkpoints(root)
    if not found:
        return
    if opts.resume == "latest" or (opts.resume is not None and _inside(Path(opts.resume), root)):
        return  # continuing the run those checkpoints belong to
    names = ", ".join(p.name for p in found)
    what = "a fresh run" if opts.resume is None else f"a run resumed from {opts.resume}"
    raise ConfigError(
        f"--checkpoint_dir {root} holds the checkpoints of another run ({names}), which {what} would "
        f"rotate away. Fix: --resume to continue that run, --overwrite to delete them and start anew, or "
        "another --checkpoint_dir."
    )


def open_checkpoints(opts: TrainOptions, rank: int, log: Callable[[str], None]) -> Any:
    """The run's recir.distributed.CheckpointManager (None when this process writes no checkpoints);
    --overwrite deletes the previous run's checkpoints here and logs them."""
    from recir.distributed import CheckpointManager

    if not opts.checkpoint_dir or not (opts.checkpoint_every or opts.overwrite):
        return None
    if opts.wants_multihost() and rank != 0:
        return None  # several JAX processes: process 0 alone writes (the global tensors)
    existing = "overwrite" if opts.overwrite else "continue"
    manager = CheckpointManager(opts.checkpoint_dir, keep=opts.keep_checkpoints, existing=existing)
    if manager.removed:
        names = ", ".join(p.name for p in manager.removed)
        log(
            f"--overwrite: removed {len(manager.removed)} checkpoint(s) of a previous run from {opts.checkpoint_dir}: {names}"
        )
    return manager


def resume_point(opts: TrainOptions) -> tuple[Path, int] | None:
    """(checkpoint, its step) to resume from, or None (no --resume, or nothing written yet). Checks the
    checkpoint directory, every file's checksum and the configuration first: a `ConfigError` (one
    problem per line: `CheckpointMismatchError.problems`) or `DataError` before anything is built."""
    from recir.distributed import CheckpointMismatchError, latest_checkpoint

    opts.check()
    check_checkpoint_dir(opts)
    if opts.resume is None:
        return None
    if opts.resume == "latest":
        path = latest_checkpoint(opts.checkpoint_dir or "")
        if path is None:
            return None  # nothing written yet: start from scratch
    else:
        try:
            path = resolve_checkpoint(opts.resume)
        except DataError:
            raise DataError(f"--resume {opts.resume}: no complete checkpoint found there") from None
    meta = _verified(path)
    problems = config_problems(path, meta, opts)
    if problems:
        raise CheckpointMismatchError(problems)
    return path, int(meta["step"])


def _verified(path: Path) -> dict[str, Any]:
    """The checkpoint's metadata once every file matches its checksum; else a DataError naming the file
    and the previous checkpoint to resume from instead."""
    from recir.distributed import list_checkpoints, verify_checkpoint

    try:
        meta = verify_checkpoint(path)
        if not isinstance(meta.get("step"), int):
            raise DataError(f"{path / 'recir.json'}: damaged (no integer 'step')")
        return meta
    except DataError as e:
        try:
            run = list_checkpoints(path.parent)
        except DataError:
            run = []
        earlier = [p for p in run[: run.index(path)]] if path in run else []
        fix = (
            f"resume from the previous checkpoint: --resume {earlier[-1]}"
            if earlier
            else f"no earlier checkpoint of this run remains in {path.parent}; start anew (--overwrite)"
        )
        raise DataError(f"{e}. Fix: {fix}") from None


def config_problems(path: Path, meta: dict[str, Any], opts: TrainOptions) -> list[str]:
    """One line per configuration value the checkpoint at `path` and this run disagree on."""
    saved = meta.get("config")
    if not isinstance(saved, dict):
        return [
            f"--resume {path}: the checkpoint records no run configuration (written by an older "
            "recir-dlrmv3), so the resume cannot be checked. Fix: start anew (--overwrite, or another "
            "--checkpoint_dir)"
        ]
    run = run_config(opts)
    problems = []
    for key in [*run, *(k for k in saved if k not in run)]:
        flag = f"ModelConfig.{key[6:]}" if key.startswith("model.") else f"--{key}"
        if key not in saved:
            problems.append(
                f"--resume {path}: {flag} is not recorded in the checkpoint (this run: {run[key]})"
            )
        elif key not in run:
            problems.append(f"--resume {path}: {flag} is {saved[key]} in the checkpoint, unknown to this run")
        elif saved[key] != run[key]:
            fix = f"pass {flag} {saved[key]}" if flag.startswith("--") else "use the code it was trained with"
            problems.append(
                f"--resume {path}: {flag} is {saved[key]} in the checkpoint, {run[key]} in this run. Fix: {fix}"
            )
    return problems


def _compare_layout(slots: dict[str, Any]) -> dict[str, Any]:
    """Slots as a resume compares them: eager's per-parameter steps are the captured step's shared one,
    and the captured step's per-group learning rates are left out (--lr / --sparse_lr are compared)."""
    out = shared_step_layout(slots, lambda a, b: a == b)
    return {k: v for k, v in out.items() if not (k.startswith("optim:") and parse_slot_name(k).is_lr)}


def run_slots(trainer: Trainer) -> dict[str, Any]:
    """{slot: (global shape, dtype)} of every slot `trainer` trains and checkpoints."""
    from recir.distributed import slot_specs

    specs = slot_specs(trainer.state_dict(), trainer.checkpoint_plan)
    if isinstance(trainer, EagerTrainer):
        specs.update(_lazy_optimizer_slots(trainer.model, trainer.optimizers))
    return specs


def _lazy_optimizer_slots(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """The optimizer-state slots eager training holds after its first step (torch.optim creates Adam's
    state lazily): one zero-gradient step of meta-device twins of the optimizers (no memory, no compute)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, Any] = {}
    for opt in optimizers:
        twin_names: dict[int, str] = {}
        groups = []
        for group in opt.param_groups:
            params = []
            for p in group["params"]:
                t = torch.empty_like(p, device="meta").requires_grad_()
                t.grad = torch.zeros_like(t)
                twin_names[id(t)] = names[id(p)]
                params.append(t)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
        twin = type(opt)(groups)
        if any(t not in twin.state for g in twin.param_groups for t in g["params"]):
            twin.step()
        for t, state in twin.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    dtype = str(value.dtype).removeprefix("torch.")
                    out[optim_slot(twin_names[id(t)], key)] = (tuple(value.shape), dtype)
    return out


def _table_dtype_changes(problems: list[Any]) -> tuple[list[Any], list[Any]]:
    """``(converted, rest)``: the parameter slots saved in another dtype that a table may be stored in
    (float32, or one of recir-embed-table-dtype's), which a resume converts; every other problem."""
    from recir.embedding import TABLE_DTYPES

    stored = {"float32", *(str(d).removeprefix("torch.") for d in TABLE_DTYPES.values())}
    converted = [
        p
        for p in problems
        if p.kind == "dtype" and p.slot.startswith("param:") and {p.checkpoint, p.run} <= stored
    ]
    return converted, [p for p in problems if p not in converted]


def restore(trainer: Trainer, path: Path, opts: TrainOptions) -> list[str]:
    """Loads checkpoint `path` into `trainer` once every slot fits: a slot missing from the checkpoint or
    one this run does not have is an error unless --allow_fresh_slots names it, and so is any shape or
    dtype difference (all listed, `CheckpointMismatchError`), except a parameter saved in another of
    --table_dtype's dtypes (float32, float16, bfloat16), which is converted. Returns one line per
    conversion, for the log."""
    from recir.distributed import CheckpointMismatchError, compare_slots, load_resharded, saved_slots

    saved = saved_slots(path) or {}
    wanted = run_slots(trainer)
    saved_c, wanted_c = _compare_layout(saved), _compare_layout(wanted)
    problems = compare_slots(saved_c, wanted_c, opts.allow_fresh_slots)
    converted, problems = _table_dtype_changes(problems)
    if problems:
        lines = []
        for p in problems:
            if p.kind in ("missing", "extra"):  # e.g. the RNG of another --target: eager vs captured
                fix = f"--allow_fresh_slots '{p.slot}' (or a pattern such as 'rng:*') to accept that"
            else:
                fix = "resume with the flags it was written with"
            lines.append(f"--resume {path}: {p}. Fix: {fix}")
        raise CheckpointMismatchError(lines)
    # Read every saved slot this run uses (eager per-parameter steps feed the shared `optim:step`), not the
    # dropped ones; the files were verified by resume_point.
    dropped = {k for k in saved_c if k not in wanted_c}
    read = [k for k in saved if k not in dropped]
    state = load_resharded(path, trainer.checkpoint_plan, slots=read, verify=False)
    if STEP_SLOT in wanted:
        state = {k: v for k, v in with_shared_step(state).items() if k in wanted}
    lines = []
    for p in converted:  # --table_dtype changed since the checkpoint: the table in this run's dtype
        dtype = getattr(torch, p.run)
        widened = torch.finfo(dtype).bits > torch.finfo(getattr(torch, p.checkpoint)).bits
        value = state[p.slot].to(dtype)
        if not widened and bool((value.isinf() & state[p.slot].isfinite()).any()):
            raise DataError(
                f"--resume {path}: {p.slot} has values beyond {p.run}'s range, saved as {p.checkpoint}. "
                f"Fix: resume with the --table_dtype it was written with"
            )
        state[p.slot] = value
        how = "widened exactly" if widened else "rounded to nearest"
        lines.append(f"--resume: {p.slot} saved as {p.checkpoint}, this run stores it as {p.run} ({how})")
    trainer.load_state_dict(state)
    return lines
