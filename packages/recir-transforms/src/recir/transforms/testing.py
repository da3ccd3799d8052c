"""Helpers for building StepGraphs by hand in tests (no recir-capture needed)."""

from ._phase_tracing import mark_phase as mark_phase
from ._phase_tracing import trace_with_phases as trace_with_phases

__all__ = ["mark_phase", "trace_with_phases"]
