"""Whole-step CUDA graphs: capture the compiled in-place step once, then replay it every step.

State lives at fixed addresses (it is updated in place), so only the batch is copied into static
buffers. A step whose state moved (``load_state_dict``) is re-captured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger("recir.lower_gpu")


class CudaGraphStep:
    """Runs ``fn(*state, *batch) -> outputs`` (which updates state in place) through a CUDA graph.

    The first call for a given set of state addresses runs ``fn`` normally on a side stream (the
    warm-up: lazy kernel loading, cuBLAS workspaces, Triton autotuning) and is a real step; it then
    captures ``fn`` (capture records kernels without running them), so state advances exactly once.
    """

    def __init__(self, fn: Callable[..., Sequence[torch.Tensor]], device: torch.device) -> None:
        self._fn = fn
        self._device = device
        self._graph: torch.cuda.CUDAGraph | None = None
        self._key: tuple[int, ...] | None = None
        self._static_batch: list[torch.Tensor] = []
        self._static_out: Sequence[torch.Tensor] = ()
        self.disabled_reason: str | None = None

    def __call__(self, state: Sequence[torch.Tensor], batch: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.disabled_reason is not None:
            return list(self._fn(*state, *batch))
        key = tuple(t.data_ptr() for t in state)
        if self._graph is None or key != self._key:
            return self._warm_up_and_capture(state, batch, key)
        for dst, src in zip(self._static_batch, batch):
            dst.copy_(src, non_blocking=True)
        self._graph.replay()
        # The static outputs are overwritten by the next replay; hand the caller its own copies.
        return [o.clone() for o in self._static_out]

    def _warm_up_and_capture(
        self, state: Sequence[torch.Tensor], batch: Sequence[torch.Tensor], key: tuple[int, ...]
    ) -> list[torch.Tensor]:
        current = torch.cuda.current_stream(self._device)
        side = torch.cuda.Stream(self._device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = list(self._fn(*state, *batch))
        current.wait_stream(side)
        try:
            static_batch = [b.clone() for b in batch]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = self._fn(*state, *static_batch)
        except Exception as exc:  # capture-unsafe op (host sync, CPU fallback): run without graphs
            self.disabled_reason = f"{type(exc).__name__}: {exc}"
            log.warning("recir.lower_gpu: CUDA graph capture failed, running without: %s", exc)
            return out
        self._graph, self._key = graph, key
        self._static_batch, self._static_out = static_batch, static_out
        log.info("recir.lower_gpu: captured the step as one CUDA graph")
        return out
