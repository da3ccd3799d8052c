"""RecIR's exception hierarchy, shared by every package (this is the leaf package).

Each error says what failed, expected versus actual, and how to fix it (docs/design.md, "Errors and tests").
"""

from __future__ import annotations


class RecIRError(Exception):
    """Base class of every error RecIR raises on purpose."""


class VerificationError(RecIRError):
    """A StepGraph broke an invariant (INV-*); the message names the id, transform and node."""

    def __init__(
        self, message: str, *, invariant: str, transform: str | None = None, node: str | None = None
    ):
        super().__init__(message)
        self.invariant = invariant
        self.transform = transform
        self.node = node


class CaptureError(RecIRError):
    """A training step could not be captured as one functional graph."""


class LoweringError(RecIRError):
    """A StepGraph could not be lowered to a backend."""


class ConfigError(RecIRError):
    """A configuration (flags, plan, options) is invalid."""


class DataError(RecIRError):
    """Input data (a batch, a file) is malformed."""
