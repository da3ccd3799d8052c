"""Built-in transforms, one per module; importing this package registers them by name."""

from .cse import CommonSubexpressionElimination as CommonSubexpressionElimination
from .dce import DeadCodeElimination as DeadCodeElimination
from .mixed_precision import MixedPrecision as MixedPrecision
from .recompute import RECOMPUTE_KEY as RECOMPUTE_KEY
from .recompute import Recompute as Recompute
from .recompute import transient_peak_bytes as transient_peak_bytes

__all__ = [
    "RECOMPUTE_KEY",
    "CommonSubexpressionElimination",
    "DeadCodeElimination",
    "MixedPrecision",
    "Recompute",
    "transient_peak_bytes",
]
