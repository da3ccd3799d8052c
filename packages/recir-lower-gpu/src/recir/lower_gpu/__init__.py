"""recir.lower_gpu: Lower a RecIR StepGraph to the GPU stack: Inductor, FBGEMM and torch.distributed."""

from recir.transforms import LoweringError as LoweringError

from ._cache import inductor_cache_dir as inductor_cache_dir
from ._cache import recir_cache_dir as recir_cache_dir
from ._compile import compile as compile
from ._compile import resolve_device as resolve_device
from ._export import export as export
from ._export import package as package
from ._fused_tbe import FusedTBECompiledStep as FusedTBECompiledStep
from ._host_memory import retain_host_memory as retain_host_memory
from ._options import INDUCTOR_MODES as INDUCTOR_MODES
from ._options import GPUOptions as GPUOptions
from ._ranks import compile_in_turn as compile_in_turn
from ._step import GPUCompiledStep as GPUCompiledStep

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # lowering
    "compile",
    "export",
    "package",
    "GPUCompiledStep",
    "FusedTBECompiledStep",
    "GPUOptions",
    "INDUCTOR_MODES",
    "resolve_device",
    "compile_in_turn",
    # host runtime
    "retain_host_memory",
    # compile cache
    "inductor_cache_dir",
    "recir_cache_dir",
    # errors
    "LoweringError",
]
