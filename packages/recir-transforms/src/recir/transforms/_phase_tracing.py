"""Tracing hand-written pure steps with make_fx while tagging ``recir.phase`` by position.

For tests and tools that build StepGraphs without recir-capture: the step calls ``mark_phase`` where
the backward and the optimizer begin, and every node traced since the last mark gets the old phase.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from ._step import PHASE_KEY

_CURRENT = ["forward"]


def _tag_untagged(graph: fx.Graph, phase: str) -> None:
    for node in graph.nodes:
        if node.op == "call_function" and PHASE_KEY not in node.meta:
            node.meta[PHASE_KEY] = phase


def mark_phase(phase: str) -> None:
    """Inside ``trace_with_phases``: every node created from here on belongs to ``phase``."""
    mode = get_proxy_mode()
    if mode is not None:
        _tag_untagged(mode.tracer.graph, _CURRENT[0])
        _CURRENT[0] = phase


def trace_with_phases(fn: Callable[..., Any], *args: Any, tracing_mode: str = "fake") -> fx.GraphModule:
    """``make_fx(fn)(*args)`` with ``recir.phase`` on every compute node (forward until the first mark)."""
    _CURRENT[0] = "forward"
    gm = make_fx(fn, tracing_mode=tracing_mode)(*args)
    _tag_untagged(gm.graph, _CURRENT[0])
    return gm
