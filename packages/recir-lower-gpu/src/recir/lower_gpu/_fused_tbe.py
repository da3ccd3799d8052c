"""``embedding_backend="fbgemm"`` with ``GPUOptions(fused_tbe=True)``: the tables trained by FBGEMM's split
TBE with its fused backward + optimizer, the rest of the step compiled by Inductor.

Each step: TBE forward (the rows) -> the compiled dense step (the loss, the dense update, the rows'
gradients) -> TBE backward, which applies the captured optimizer to the touched rows in place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from recir.embedding import FusedTBE, HostSplit
from recir.transforms import ConfigError, StepGraph
from torch import nn

from ._step import GPUCompiledStep


class FusedTBECompiledStep:
    """A step whose tables FBGEMM's TBE trains; implements recir.transforms' ``CompiledStep``.

    ``state`` is the full step's state in its signature order, so checkpoints are interchangeable with an
    unfused run's: the tables and their optimizer state are views of the TBEs' buffers (updated in place
    by TBE's backward), every other slot a device tensor of ``dense``, the compiled rest of the step.
    """

    def __init__(self, step: StepGraph, split: HostSplit, dense: GPUCompiledStep, tbe: FusedTBE) -> None:
        self.step = step
        self.split = split
        self.dense = dense
        self.tbe = tbe
        self.device = dense.device
        self.options = dense.options
        self.plan = dense.plan
        self.embedding_backend = "fbgemm"
        self.cache_dir = dense.cache_dir
        #: the rewrites from capture's output to Inductor's input, the cut at the tables included
        self.pipeline = dense.pipeline
        self._host = split.host_slots
        self._dev = split.device_slots
        self._n_user = len(step.signature.outputs)
        names = step.signature.state_names()
        self._lr_index = [names.index(slot) for slot in tbe.lr_slots]

    @property
    def compile_seconds(self) -> float:
        """Seconds spent compiling the dense part (TBE is not compiled)."""
        return self.dense.compile_seconds

    @property
    def in_place(self) -> bool:
        return self.dense.in_place

    def init_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> list[torch.Tensor]:
        return self._put_state(self.step.init_state(model, optimizer))

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        return self._put_state(self.step.load_state_dict(state_dict))

    def state_dict(self, state: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Slot name -> the live state tensor (TBE's buffers change in place: clone to snapshot)."""
        return self.step.state_dict(state)

    def __call__(self, state: Sequence[torch.Tensor], batch: Any) -> tuple[list[torch.Tensor], Any]:
        """One step; the returned state holds TBE's views and the dense part's (in-place) tensors."""
        self._check_state(state)
        flat = self.step.signature.flatten_batch(batch)
        host = self.tbe.load([state[i] for i in self._host])  # no copy when state already holds the views
        rows = self.tbe.lookup(host, flat, [state[i] for i in self._lr_index])
        new_dev, outs = self.dense([state[i] for i in self._dev], [*flat, *rows])
        outs = list(outs)  # the dense part's signature has no output tree: a flat tuple
        self.tbe.backward(outs[self._n_user :])
        new_state: list[torch.Tensor] = list(state)
        for i, x in zip(self._host, host):
            new_state[i] = x
        for i, x in zip(self._dev, new_dev):
            new_state[i] = x
        return new_state, self.step.unflatten_outputs(outs[: self._n_user])

    def _put_state(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        state: list[Any] = [None] * len(tensors)
        for i, view in zip(self._host, self.tbe.load([tensors[i] for i in self._host])):
            state[i] = view
        dense = self.dense._to_device([tensors[i] for i in self._dev], copy=True)
        for i, x in zip(self._dev, dense):
            state[i] = x
        return state

    def _check_state(self, state: Sequence[torch.Tensor]) -> None:
        n = len(self.step.signature.state)
        if len(state) != n:
            raise ConfigError(
                f"compiled step expects {n} state tensors (signature order), got {len(state)}. "
                "Fix: build state with compiled.init_state(model, optimizer) or compiled.load_state_dict(sd)."
            )

    def __repr__(self) -> str:
        return f"FusedTBECompiledStep({self.tbe!r}, dense part: {self.dense!r})"
