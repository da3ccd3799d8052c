"""Learning rates live in ``optim:group<i>:lr`` state slots, so a scheduler changes them without recapture."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from recir.transforms import ConfigError, StepGraph

from ._optim_map import all_param_groups

LR_SLOTS_META = "recir.lr_slots"


def _lr_indices(step: StepGraph, group: int | None) -> list[int]:
    slots = step.meta.get(LR_SLOTS_META)
    if slots is None:
        raise ConfigError(
            "this StepGraph carries no learning-rate slots (meta 'recir.lr_slots').\n"
            "Fix: use a step made by recir.capture.capture_train_step."
        )
    if group is not None and not 0 <= group < len(slots):
        raise ConfigError(f"param group {group} does not exist; the step has {len(slots)} group(s)")
    chosen = slots if group is None else [slots[group]]
    return [step.signature.state_index(name) for name in chosen]


def set_learning_rate(
    step: StepGraph, state: Sequence[torch.Tensor], lr: float, group: int | None = None
) -> list[torch.Tensor]:
    """A new state list with the learning rate of ``group`` (all groups if None) set to ``lr``.

    The old lr tensors are not written to (new tensors replace them), so a donated state stays valid.
    """
    new = list(state)
    for i in _lr_indices(step, group):
        new[i] = torch.full_like(new[i], float(lr))
    return new


def sync_learning_rates(step: StepGraph, state: Sequence[torch.Tensor], optimizer: Any) -> list[torch.Tensor]:
    """A new state list with every group's lr from ``optimizer.param_groups`` (after a scheduler step).

    ``optimizer`` may be the list of optimizers the step was captured with.
    """
    indices = _lr_indices(step, None)
    groups = all_param_groups(optimizer)
    if len(indices) != len(groups):
        raise ConfigError(
            f"the step was captured with {len(indices)} param group(s), the optimizer(s) have "
            f"{len(groups)}.\nFix: recapture after adding param groups."
        )
    new = list(state)
    for i, g in zip(indices, groups):
        new[i] = torch.full_like(new[i], float(g["lr"]))
    return new


def learning_rates(step: StepGraph, state: Sequence[torch.Tensor]) -> list[float]:
    """The current per-group learning rates held in ``state``."""
    return [float(state[i]) for i in _lr_indices(step, None)]
