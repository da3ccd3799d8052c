"""Built-in transforms, one per module; importing this package registers them by name."""

from .cse import CommonSubexpressionElimination as CommonSubexpressionElimination
from .dce import DeadCodeElimination as DeadCodeElimination
from .mixed_precision import MixedPrecision as MixedPrecision

__all__ = ["CommonSubexpressionElimination", "DeadCodeElimination", "MixedPrecision"]
