"""recir.lower_tpu: lower a RecIR StepGraph to the TPU stack, torchax to JAX/XLA (jit, donation, GSPMD)."""

from recir.transforms import LoweringError as LoweringError

# isort: off
from . import _versions  # noqa: F401 - first: refuses a known-broken torch/torchax pair before torchax loads
from . import _torchax_device  # noqa: F401 - torch.compile keeps working once torchax is imported

# isort: on
from ._cache import default_cache_dir as default_cache_dir
from ._cache import enable_compile_cache as enable_compile_cache
from ._compile import TPUCompiledStep as TPUCompiledStep
from ._compile import TPUOptions as TPUOptions
from ._compile import compile as compile
from ._host_split import HostSplitCompiledStep as HostSplitCompiledStep
from ._multihost import initialize_distributed as initialize_distributed
from ._multihost import sync_processes as sync_processes
from ._profile import node_seconds as node_seconds
from ._registry import register_jax_lowering as register_jax_lowering
from ._registry import registered_jax_lowerings as registered_jax_lowerings
from ._ring_kernel import local_gather as local_gather
from ._ring_kernel import local_scatter_add as local_scatter_add
from ._ring_kernel import ring_shift_lookup as ring_shift_lookup
from ._ring_kernel import ring_shift_scatter_add as ring_shift_scatter_add

__version__ = "0.1.0"

__all__ = [
    # lowering a StepGraph
    "compile",
    "TPUCompiledStep",
    "TPUOptions",
    "HostSplitCompiledStep",
    # multi-process (multi-host) JAX
    "initialize_distributed",
    "sync_processes",
    # profiles: seconds per StepGraph node from a jax.profiler trace
    "node_seconds",
    # the ring shift (row-sharded lookups) and its Pallas TPU kernels
    "ring_shift_lookup",
    "ring_shift_scatter_add",
    "local_gather",
    "local_scatter_add",
    # lowerings of ops
    "register_jax_lowering",
    "registered_jax_lowerings",
    # the compilation cache
    "default_cache_dir",
    "enable_compile_cache",
    # errors
    "LoweringError",
]
