"""The CompiledStep protocol shared by both lowerings (recir-lower-gpu and recir-lower-tpu)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class CompiledStep(Protocol):
    """A StepGraph lowered to a backend. State updates in place (donation or a copy epilogue)."""

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling (0.0 until the first call compiles)."""
        ...

    def init_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """The backend's state (a flat list in signature order) built from a live model and optimizer."""
        ...

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        """One step: ``(state, outputs)``, the loss first in ``outputs``."""
        ...

    def state_dict(self, state: Any) -> dict[str, torch.Tensor]:
        """Slot name -> torch tensor (on the host for non-torch backends)."""
        ...

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> Any:
        """The backend's state from slot name -> tensor."""
        ...
