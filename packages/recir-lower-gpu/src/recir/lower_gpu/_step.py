"""GPUCompiledStep: a StepGraph compiled by Inductor, implementing recir.transforms' CompiledStep.

State is a flat list of device tensors in signature order; a step updates it in place (unless
``GPUOptions(in_place=False)``) and returns the same list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from recir.transforms import ConfigError, Pipeline, RegionTime, StepGraph
from torch import nn

from ._cudagraph import CudaGraphStep
from ._options import GPUOptions


class GPUCompiledStep:
    """One compiled training step. ``state, outputs = compiled(state, batch)``; the loss is ``outputs[0]``."""

    def __init__(
        self,
        *,
        step: StepGraph,
        device: torch.device,
        options: GPUOptions,
        plan: Any,
        embedding_backend: str,
        fn: Callable[..., Sequence[torch.Tensor]],
        cuda_graph: CudaGraphStep | None,
        compile_seconds: float,
        cache_dir: Path,
        pipeline: Pipeline | None = None,
    ) -> None:
        self.step = step
        self.device = device
        self.options = options
        self.plan = plan
        self.embedding_backend = embedding_backend
        self.cache_dir = cache_dir
        #: the rewrites from capture's output to Inductor's input (``pipeline.report()``)
        self.pipeline = pipeline
        self._fn = fn
        self._cuda_graph = cuda_graph
        self._compile_seconds = compile_seconds
        self._num_state = len(step.signature.state)
        self._checked_state: tuple[int, ...] | None = None

    @property
    def compile_seconds(self) -> float:
        """Seconds spent preparing and compiling (a warm Inductor cache makes this small)."""
        return self._compile_seconds

    @property
    def in_place(self) -> bool:
        return self.options.in_place

    def region_times(self, events: Iterable[Any]) -> list[RegionTime] | None:
        """Time per region from a torch profiler's averaged events (``prof.key_averages()``) over steps of
        this compiled step: each piece of ``GPUOptions(regions="repeated")`` runs under a profiler event
        naming its region (a repeated module instance such as ``layers.3`` in one phase, or ``(glue)``),
        largest first, as recir.transforms' ``RegionTime`` rows (``format_region_table``). Host time: on
        CUDA a piece's kernels run asynchronously, so read the kernel table there. None when the step was
        compiled whole (no pieces to tell apart)."""
        from ._regions import REGION_EVENT, RegionsFn

        if not isinstance(self._fn, RegionsFn) or not self._fn.regions:
            return None
        nodes: dict[str, int] = {}
        for r in self._fn.regions:
            nodes[r.event] = nodes.get(r.event, 0) + r.nodes
        rows = []
        for e in events:
            if e.key.startswith(REGION_EVENT) and e.key in nodes:
                scope, phase = e.key[len(REGION_EVENT) :].rsplit(" ", 1)
                rows.append(RegionTime(scope, phase, e.cpu_time_total / 1e6, nodes[e.key]))
        return sorted(rows, key=lambda r: -r.seconds)

    # -- state -------------------------------------------------------------------------------------
    def _to_device(self, tensors: Sequence[torch.Tensor], *, copy: bool) -> list[torch.Tensor]:
        out = []
        for t in tensors:
            t = t.detach()
            if copy or t.device != self.device:
                t = t.to(self.device, copy=True)
            out.append(t.contiguous())
        if self.device.type == "cpu" and self.options.huge_pages_min_bytes is not None:
            from recir.embedding import advise_large_buffers

            # in place, contents unchanged: the large tables' row lookups and updates stop missing the TLB
            advise_large_buffers(((t.data_ptr(), t.nbytes) for t in out), self.options.huge_pages_min_bytes)
        return out

    def init_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        share_model: bool = False,
        release: Callable[[str], None] | None = None,
    ) -> list[torch.Tensor]:
        """Fresh device tensors (never aliasing the model or optimizer) in signature order. ``share_model``
        (with ``in_place``): the model's parameters and buffers already on this device, contiguous, are
        the state themselves, so each step trains the model in place and the process holds one copy of
        its weights (``StepGraph.init_state(share_model=True)``). ``release(slot_name)`` is called as soon
        as a slot's tensor exists, and each slot is built only then, so a caller that drops the model's
        tensor there (DLRMv3's tables stored fp16) holds one converted table at a time beside the model's."""
        if share_model and not self.in_place:
            raise ConfigError(
                "init_state(share_model=True) needs GPUOptions(in_place=True): a step that returns fresh state "
                "tensors would leave the model behind. Fix: compile with in_place=True, or share_model=False."
            )
        # init_slot already copies (unless shared); moving to the device copies only when the device
        # differs, and .contiguous() only when the model's tensor is not.
        out = []
        for slot in self.step.signature.state:
            out += self._to_device(
                [self.step.init_slot(slot, model, optimizer, share_model=share_model)], copy=False
            )
            if release is not None:
                release(slot.name)
        return out

    def state_dict(self, state: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Slot name -> the live state tensor (updated in place by later steps; clone to snapshot)."""
        return self.step.state_dict(state)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Device state from slot name -> tensor; copies, so later in-place steps never touch ``state_dict``."""
        return self._to_device(self.step.load_state_dict(state_dict), copy=True)

    def _check_state(self, state: Sequence[torch.Tensor]) -> None:
        if len(state) != self._num_state:
            raise ConfigError(
                f"compiled step expects {self._num_state} state tensors (signature order), got {len(state)}. "
                "Fix: build state with compiled.init_state(model, optimizer) or compiled.load_state_dict(sd)."
            )
        key = tuple(t.data_ptr() for t in state)
        if key == self._checked_state:
            return
        for slot, t in zip(self.step.signature.state, state):
            if t.device != self.device or t.dtype != slot.dtype or tuple(t.shape) != slot.shape:
                raise ConfigError(
                    f"state {slot.name!r}: expected {slot.dtype}{list(slot.shape)} on {self.device}, "
                    f"got {t.dtype}{list(t.shape)} on {t.device}. Fix: build state with "
                    "compiled.init_state(...) or compiled.load_state_dict(...)."
                )
            if not t.is_contiguous():
                raise ConfigError(f"state {slot.name!r} is not contiguous. Fix: pass t.contiguous().")
        self._checked_state = key

    # -- running -------------------------------------------------------------------------------------
    def __call__(self, state: Sequence[torch.Tensor], batch: Any) -> tuple[Any, Any]:
        """One training step: ``(state, outputs)``. In place: the returned state is ``state`` itself."""
        self._check_state(state)
        flat = self.step.signature.flatten_batch(batch)
        flat = [t.to(self.device, non_blocking=True).contiguous() for t in flat]
        if not self.options.in_place:
            out = list(self._fn(*state, *flat))
            return out[: self._num_state], self.step.unflatten_outputs(out[self._num_state :])
        if self._cuda_graph is not None:
            outputs = self._cuda_graph(state, flat)
        else:
            outputs = list(self._fn(*state, *flat))
        return state, self.step.unflatten_outputs(outputs)

    def __repr__(self) -> str:
        return (
            f"GPUCompiledStep(device={self.device}, mode={self.options.mode}, in_place={self.in_place}, "
            f"embedding_backend={self.embedding_backend}, compile_seconds={self._compile_seconds:.2f})"
        )
