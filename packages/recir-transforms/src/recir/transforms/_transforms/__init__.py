"""Built-in transforms, one per module; importing this package registers them by name."""

from .cse import CommonSubexpressionElimination as CommonSubexpressionElimination
from .dce import DeadCodeElimination as DeadCodeElimination
from .inline_references import InlineReferences as InlineReferences
from .mixed_precision import MixedPrecision as MixedPrecision
from .narrow import Narrow as Narrow
from .narrow import Narrowing as Narrowing
from .pipeline_sparse import PIPELINE_SPARSE_KEY as PIPELINE_SPARSE_KEY
from .pipeline_sparse import PipelineSparse as PipelineSparse
from .pipeline_sparse import SparsePipelineInfo as SparsePipelineInfo
from .recompute import RECOMPUTE_KEY as RECOMPUTE_KEY
from .recompute import Recompute as Recompute
from .recompute import transient_peak_bytes as transient_peak_bytes
from .split_concat import SplitConcatProducts as SplitConcatProducts

__all__ = [
    "PIPELINE_SPARSE_KEY",
    "RECOMPUTE_KEY",
    "CommonSubexpressionElimination",
    "DeadCodeElimination",
    "InlineReferences",
    "MixedPrecision",
    "Narrow",
    "Narrowing",
    "PipelineSparse",
    "Recompute",
    "SparsePipelineInfo",
    "SplitConcatProducts",
    "transient_peak_bytes",
]
