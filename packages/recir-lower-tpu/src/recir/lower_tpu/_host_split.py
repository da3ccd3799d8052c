"""``embedding_backend="cpu"``: the tables on the host (PyTorch on the CPU), the rest of the step one jitted
JAX program. Each step: host lookups -> device step -> host row updates with the returned row gradients.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import torch
from recir.embedding import HostEmbeddings, HostSplit, advise_large_buffers
from recir.transforms import ConfigError, StepGraph
from torch import nn

from ._convert import check_state_count
from ._host_checks import HostCheck


class HostSplitCompiledStep:
    """A step whose tables live on the host; implements recir.transforms' ``CompiledStep``.

    ``state`` is the full step's state in its signature order (so checkpoints match an ``in_graph``
    run's): the host tables and their optimizer state as torch CPU tensors, updated in place by
    ``host``; every other slot a JAX array owned (and donated) by ``device``, a ``TPUCompiledStep`` of the
    split's device part. The host's lookups must finish before the device step starts and its update
    needs the device's row gradients, so the three run one after another (no overlap yet).
    """

    def __init__(
        self,
        step: StepGraph,
        split: HostSplit,
        device: Any,
        host: HostEmbeddings,
        host_checks: Sequence[HostCheck] = (),
    ) -> None:
        self.step = step
        self.split = split
        self.device = device
        self.host = host
        self.host_checks = list(host_checks)
        self._host = split.host_slots
        self._dev = split.device_slots
        self._n_user = len(step.signature.outputs)
        #: the rewrites from capture's output to torchax's input, the cut at the tables included
        self.pipeline = device.pipeline

    @property
    def compile_seconds(self) -> float:
        """Seconds the first call spent compiling the device part (the host part is not compiled)."""
        return float(self.device.compile_seconds)

    @property
    def trace_seconds(self) -> float:
        """Of ``compile_seconds``, the device part's tracing to StableHLO (TPUCompiledStep.trace_seconds)."""
        return float(self.device.trace_seconds)

    @property
    def placement(self) -> Any:
        return self.device.placement

    def init_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[Any]:
        return self._put_state(self.step.init_state(model, optimizer))

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> list[Any]:
        return self._put_state(self.step.load_state_dict(state_dict))

    def state_dict(self, state: Sequence[Any]) -> dict[str, torch.Tensor]:
        """Host tensors by slot name (host slots copied: the live ones change in place each step)."""
        self._check_state(state)
        out = self.device.state_dict([state[i] for i in self._dev])
        names = self.step.signature.state_names()
        out.update({names[i]: state[i].detach().clone() for i in self._host})
        return {name: out[name] for name in names}

    def __call__(self, state: Sequence[Any], batch: Any) -> tuple[list[Any], Any]:
        """One step. The device slots of ``state`` are donated, the host slots updated in place: use the
        returned state afterwards."""
        self._check_state(state)
        flat = self.step.signature.flatten_batch(batch)
        for check in self.host_checks:  # DataError before a host kernel reads an out-of-range id
            check(flat)
        host_state = [state[i] for i in self._host]
        rows = self.host.lookup(host_state, flat)
        new_dev, outs = self.device([state[i] for i in self._dev], [*flat, *rows])
        outs = list(outs)
        self.host.update(host_state, flat, [torch.as_tensor(x) for x in outs[self._n_user :]])
        new_state: list[Any] = list(state)
        for i, x in zip(self._dev, new_dev):
            new_state[i] = x
        return new_state, self.step.unflatten_outputs(outs[: self._n_user])

    def _put_state(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        state: list[Any] = [None] * len(tensors)
        for i in self._host:  # owned by the host part: a private contiguous CPU copy, updated in place
            state[i] = tensors[i].detach().to("cpu", copy=True).contiguous()
        advise_large_buffers(  # the host tables' rows: huge pages, as the device part's large buffers
            [(state[i].data_ptr(), state[i].nbytes) for i in self._host],
            self.device.options.huge_pages_min_bytes,
        )
        for i, x in zip(self._dev, self.device._put_state([tensors[i] for i in self._dev])):
            state[i] = x
        return state

    def _check_state(self, state: Sequence[Any]) -> None:
        check_state_count(self.step, state)
        names = self.step.signature.state_names()
        for i in self._host:
            if not isinstance(state[i], torch.Tensor):
                raise ConfigError(
                    f"state slot {names[i]!r} lives on the host (embedding_backend='cpu') and must be a torch "
                    f"tensor, got {type(state[i]).__name__}. Fix: build state with compiled.init_state(...) "
                    "or compiled.load_state_dict(...)."
                )
        self.device._check_state([state[i] for i in self._dev])

    def __repr__(self) -> str:
        return (
            f"HostSplitCompiledStep({len(self.split.tables)} host table(s) on the CPU "
            f"({self.host.kernels} kernels), device part on {jax.default_backend()}: {self.device!r})"
        )
