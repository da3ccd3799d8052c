"""Reads TensorBoard event files back (TensorBoard's own EventAccumulator) for the tests."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def run_dirs(logdir: Path) -> list[Path]:
    """The folders under ``logdir`` that hold event files (one per run)."""
    return sorted({p.parent for p in Path(logdir).rglob("events.out.tfevents.*")})


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Tag -> [(step, value)] of one run's scalars, in the order written."""
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
