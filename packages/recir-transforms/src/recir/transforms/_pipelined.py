"""``PipelinedStep``: runs a ``recir-pipeline-sparse`` step (steady + prologue) on any backend."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._compiled import CompiledStep
from ._errors import ConfigError
from ._pipeline import Pipeline
from ._signature import StateSlot
from ._step import StepGraph
from ._transforms.pipeline_sparse import PIPELINE_SPARSE_KEY, PipelineSparse


class PipelinedStep:
    """Feed batches in order; each call returns the outputs of the batch ``stages - 1`` calls earlier.

    ``steady`` and ``prologue`` are the two steps ``recir-pipeline-sparse`` made, compiled by the same
    backend (or left as StepGraphs: the reference interpreter). They share one state layout (the
    step's state plus ``carry:*`` slots), so ``init_state`` / ``state_dict`` / ``load_state_dict`` are
    the steady step's. The first ``stages - 1`` calls run the prologue (only the new batch's carry;
    outputs ``None``); :meth:`flush` trains the batches still in flight by re-running the steady step on
    the last batch (its carry is then discarded), after which the next call starts a new fill.

    >>> pipe = PipelinedStep.build(step, stages=2, compile=lambda s: recir.lower_gpu.compile(s, plan))
    >>> state = pipe.init_state(model, opt)
    >>> for batch in loader:
    ...     state, out = pipe(state, batch)     # out: the previous batch's (loss, ...), None at first
    >>> state, rest = pipe.flush(state)         # the last batch's outputs
    """

    def __init__(
        self,
        steady: CompiledStep,
        prologue: CompiledStep,
        stages: int,
        carry_slots: Sequence[StateSlot] = (),
    ) -> None:
        if stages < 2:
            raise ConfigError(f"PipelinedStep: stages must be >= 2, got {stages}")
        self.steady, self.prologue, self.stages = steady, prologue, stages
        self.carry_slots = tuple(carry_slots)
        self.stats: Mapping[str, Any] = {}  # recir-pipeline-sparse's stats (moved, carried, ...) via build()
        self.pipeline: Pipeline | None = None  # build()'s one-transform Pipeline: .report()
        self._in_flight = 0
        self._last_batch: Any = None

    @classmethod
    def build(
        cls,
        step: StepGraph,
        stages: int = 2,
        compile: Callable[[StepGraph], CompiledStep] | None = None,  # noqa: A002 - the natural name
    ) -> PipelinedStep:
        """Pipeline ``step`` with ``recir-pipeline-sparse`` and compile both parts with ``compile``
        (default: none, the reference interpreter). A step with nothing to pipeline raises ConfigError."""
        pipeline = Pipeline([PipelineSparse(stages=stages)], name=PipelineSparse.name)
        steady = pipeline.run(step)  # builds new graphs; ``step`` is left as it is
        record = pipeline.records[0]
        if PIPELINE_SPARSE_KEY not in steady.meta:
            why = record.stats.get("reason") or f"{record.status} (RECIR_DISABLE?)"
            raise ConfigError(
                f"recir-pipeline-sparse: nothing to pipeline ({why}). Fix: distribute the step first "
                "(recir.distributed.distribute) so its ids travel by all-to-all, or train unpipelined."
            )
        prologue = steady.meta[PIPELINE_SPARSE_KEY].prologue
        fn = compile if compile is not None else (lambda s: s)
        carry = [slot for slot in steady.signature.state if slot.kind == "carry"]
        out = cls(fn(steady), fn(prologue), stages, carry)
        out.stats, out.pipeline = dict(record.stats), pipeline
        return out

    @property
    def in_flight(self) -> int:
        """Batches given but not yet trained (their outputs come from later calls or :meth:`flush`)."""
        return self._in_flight

    @property
    def compile_seconds(self) -> float:
        return float(self.steady.compile_seconds) + float(self.prologue.compile_seconds)

    def init_state(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Any:
        return self.steady.init_state(model, optimizer)

    def state_dict(self, state: Any) -> dict[str, torch.Tensor]:
        return self.steady.state_dict(state)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> Any:
        """The backend's state from slot name -> tensor; ``carry:*`` slots it lacks start as zeros, so an
        unpipelined step's state dict (a checkpoint) loads as it is."""
        full = dict(state_dict)
        for slot in self.carry_slots:
            full.setdefault(slot.name, torch.zeros(slot.shape, dtype=slot.dtype))
        return self.steady.load_state_dict(full)

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        self._last_batch = batch
        if self._in_flight < self.stages - 1:
            state, _ = self.prologue(state, batch)
            self._in_flight += 1
            return state, None
        return self.steady(state, batch)

    def flush(self, state: Any) -> tuple[Any, list[Any]]:
        """Train the batches in flight (the last one repeated as the look-ahead); their outputs in order."""
        outs = []
        for _ in range(self.stages - 1 - self._in_flight):  # a short run: move its batches to the front
            state, _ = self.prologue(state, self._last_batch)
        for _ in range(self._in_flight):
            state, out = self.steady(state, self._last_batch)
            outs.append(out)
        self._in_flight = 0
        return state, outs

    def run(self, state: Any, batches: Iterable[Any]) -> Iterator[tuple[Any, Any]]:
        """``(state, outputs)`` for every batch of ``batches``, in order (fill and drain included)."""
        for batch in batches:
            state, out = self(state, batch)
            if out is not None:
                yield state, out
        state, rest = self.flush(state)
        for out in rest:
            yield state, out
