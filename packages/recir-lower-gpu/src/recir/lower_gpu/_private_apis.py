"""Every private torch API recir.lower_gpu uses, and the torch versions it was checked against.

`compile` and `export` check the list once per process (recir.transforms.require_private_apis): a torch
without one of them gets one LoweringError naming it, not an AttributeError from inside Inductor.
A test keeps the list complete (every `torch._*` module the package imports is listed).
"""

from __future__ import annotations

from recir.transforms import require_private_apis

CHECKED = {"torch": ("2.9.1", "2.10.0", "2.11.0", "2.12.1")}  # oldest, the lock, the H200 run, newest

PRIVATE_APIS = (
    "torch._inductor.compile_fx:compile_fx",  # compile a StepGraph's GraphModule without Dynamo
    "torch._inductor.compile_fx:compile_fx_inner",  # ... and without AOTAutograd (aot_autograd=False)
    "torch._inductor.compile_fx:_recursive_joint_graph_passes",
    "torch._inductor.virtualized:V",
    "torch._dispatch.python:enable_python_dispatcher",
    "torch._inductor.config:save_config_portable",  # the decomposed graphs' cache key
    "torch._inductor.async_compile:AsyncCompile.cpp_pybinding",  # one C++ build per compiled module
    "torch._inductor.async_compile:get_compile_threads",
    "torch._inductor.codecache:CppPythonBindingsCodeCache.load_async",
    "torch._inductor.codecache:LambdaFuture",
    "torch._inductor.config",  # per-compile patches, cpp.threads
    "torch._inductor.config:_pre_fusion_custom_pass",  # free_early
    "torch._inductor.async_compile:AsyncCompile.wait",  # regions='repeated': kernels built at the end
    "torch._inductor.custom_graph_pass:CustomGraphPass",
    "torch._inductor.dependencies:WeakDep",
    "torch._inductor.codecache:FxGraphCachePickler",  # stable cache keys across processes
    "torch._inductor.codecache:_ident",
    "torch._inductor.cpu_vec_isa:VecISA.check_build",  # the SIMD probe's on-disk memo
    "torch._inductor.cpu_vec_isa:valid_vec_isa_list",  # the probe, run ahead in a thread
    "torch._inductor.codegen.cpp:CppVecOverrides.sigmoid",  # cpu_sigmoid
    "torch._inductor.codegen.cpp:CppVecKernel.get_to_dtype_expr",  # cpu_bf16
    "torch._inductor.cpu_vec_isa:pick_vec_isa",  # cpu_bf16: does Inductor build with -mavx512bf16
    "torch._inductor.lowering:register_lowering",  # recir::store realizes its input
    "torch._inductor.lowering:lowerings",
    "torch._inductor.decomposition:select_decomp_table",
    "torch._inductor:aoti_compile_and_package",  # export
    "torch._inductor.codegen.cpp_wrapper_cpu:CppWrapperCpu",  # export: its int-array cache keyed by buffer
    "torch._inductor:aoti_load_package",
    "torch._functorch.config",
    "torch._decomp:core_aten_decompositions",
    "torch._subclasses.fake_tensor:FakeTensorMode",
    "torch._guards:TracingContext",
    "torch._guards:tracing",
    "torch._library.custom_ops:OPDEFS",
    "torch._ops:OpOverload",
    "torch._ops:OpOverloadPacket",
    "torch.autograd:_profiler_enabled",  # regions='repeated': a profiler event per piece only under one
)


def check_private_apis() -> None:
    """LoweringError if this torch lacks one of PRIVATE_APIS (checked once per process)."""
    require_private_apis("recir.lower_gpu", PRIVATE_APIS, CHECKED)
