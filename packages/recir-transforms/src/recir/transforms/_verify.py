"""The verifier: checks a StepGraph against the invariants in INVARIANTS.md (INV-1..INV-7).

(Skeleton: the full checks land with the transform framework.)
"""

from __future__ import annotations

import os

from ._step import StepGraph


def verify_level() -> int:
    """The verification level from ``RECIR_VERIFY`` (0 off, 1 phase boundaries (default), 2 every transform)."""
    raw = os.environ.get("RECIR_VERIFY", "1")
    try:
        level = int(raw)
    except ValueError:
        level = 1
    return max(0, min(2, level))


def verify(step: StepGraph, *, transform: str | None = None) -> StepGraph:
    """Check every invariant; raise VerificationError naming the invariant id. Returns ``step``."""
    del transform
    step.graph_module.graph.lint()
    return step
