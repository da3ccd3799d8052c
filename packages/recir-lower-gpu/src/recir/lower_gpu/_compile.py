"""``compile(step)``: lower a StepGraph with Inductor (CUDA when present, else the CPU device).

``gpu_pipeline`` rewrites the step (every rewrite a Transform, ``compiled.pipeline.report()`` lists
them); its output, with the in-place epilogue, is given to Inductor's ``compile_fx`` (AOTAutograd +
Inductor, no Dynamo re-trace) under a fake mode with a shape env so the FX graph and AOTAutograd caches
apply.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from recir.distributed import ShardingPlan, as_plan
from recir.embedding import CutHostSplit, FusedTBE, embedding_report, resolve_backend
from recir.transforms import ConfigError, LoweringError, Pipeline, StepGraph, verify, verify_level
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ._cache import inductor_cache_dir, recir_cache_dir, stable_cache_keys, using_cache_dir
from ._cpp_codegen import cpp_codegen
from ._cudagraph import CudaGraphStep
from ._direct import can_compile_direct, compile_direct
from ._fused_tbe import FusedTBECompiledStep
from ._isa import memoized_cpu_isa_probe, probe_in_background
from ._kernel_waits import kernels_built_at_end
from ._options import GPUOptions
from ._pipeline import InPlaceEpilogue, SplitRepeatedRegions, collectives, gpu_pipeline
from ._private_apis import check_private_apis
from ._regions import RegionsFn, RegionSplit, compile_regions
from ._step import GPUCompiledStep

log = logging.getLogger("recir.lower_gpu")


def resolve_device(device: torch.device | str | int | None) -> torch.device:
    """The device to compile for: explicit, else the current CUDA device, else the CPU."""
    if device is None:
        resolved = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    else:
        resolved = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(
            f"recir.lower_gpu: device {resolved} is not supported; expected cpu or cuda. "
            "Fix: use recir.lower_tpu for TPUs, or pass device='cuda'/'cpu'."
        )
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "recir.lower_gpu: device='cuda' but torch.cuda.is_available() is False. "
                "Fix: install the GPU stack (uv sync --group gpu) on a CUDA machine, or pass device='cpu'."
            )
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _fake_inputs(step: StepGraph, device: torch.device, fake_mode: FakeTensorMode) -> list[torch.Tensor]:
    specs = [(s.shape, s.dtype) for s in step.signature.state] + [
        (b.shape, b.dtype) for b in step.signature.batch
    ]
    with fake_mode:
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]


def _compile_fx(
    gm: fx.GraphModule,
    example: list[torch.Tensor],
    fake_mode: FakeTensorMode,
    patches: dict,
    direct: Path | bool,
):
    """Inductor on ``gm``: through AOTAutograd (``compile_fx``) when ``direct`` is False, else without it
    (recir.lower_gpu._direct; ``direct`` is the cache folder, or True for no cache)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    context = torch._guards.TracingContext(fake_mode)
    with (
        inductor_config.patch(patches),
        cpp_codegen(patches),
        functorch_config.patch(enable_autograd_cache=bool(patches.get("fx_graph_cache", True))),
        torch._guards.tracing(context),
    ):
        if direct is not False and can_compile_direct(gm):
            return compile_direct(gm, example, fake_mode, direct if isinstance(direct, Path) else None)
        return compile_fx(gm, example)


def _compile_regions(
    split: RegionSplit,
    ir: StepGraph,
    dev: torch.device,
    fake_mode: FakeTensorMode,
    patches: dict,
    direct: Path | bool,
    batch: bool,
) -> RegionsFn:
    """``GPUOptions(regions="repeated")``: the step in pieces (``split``, planned by the pipeline's
    ``recir-gpu-repeated-regions``), each distinct piece compiled once."""

    def fake(shape: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
        with fake_mode:
            return torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device=dev)

    def compile_piece(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        return _compile_fx(gm, inputs, fake_mode, patches, direct)

    # each piece's C++ kernels build while the next pieces generate their code
    with kernels_built_at_end(batch):
        fn, stats = compile_regions(split, _fake_inputs(ir, dev, fake_mode), dev, compile_piece, fake)
    log.info(
        "recir.lower_gpu: regions='repeated': %d pieces, %d distinct compiled",
        stats["pieces"],
        stats["compiled"],
    )
    return fn


def compile(
    step: StepGraph,
    plan: ShardingPlan | None = None,
    *,
    device: torch.device | str | int | None = None,
    embedding_backend: str | None = None,
    options: GPUOptions | None = None,
) -> GPUCompiledStep | FusedTBECompiledStep:
    """Lower ``step`` with Inductor and return a :class:`GPUCompiledStep` (the ``CompiledStep`` protocol).

    ``plan`` is a recir.distributed ShardingPlan (or None): its collectives are graph nodes that run on
    the initialised torch.distributed process group. ``embedding_backend`` picks recir-embedding's
    backend (default: the override ops' runtime kernels; ``in_graph`` lowers them to ATen).
    """
    options = options if options is not None else GPUOptions()
    if not isinstance(step, StepGraph):
        raise ConfigError(f"recir.lower_gpu.compile expects a StepGraph, got {type(step).__name__}")
    if step.dynamic:
        raise LoweringError(
            "recir.lower_gpu: dynamic StepGraphs are not lowered yet (the GPU path compiles static "
            "shapes). Fix: capture with mode='static' and pad or bucket batches to fixed shapes."
        )
    plan = as_plan(plan, "recir.lower_gpu.compile")
    check_private_apis()
    if verify_level() >= 1:
        verify(step)
    dev = resolve_device(device)
    use_graphs = options.use_cuda_graphs(dev.type)
    if use_graphs and not options.in_place:
        raise ConfigError(
            "GPUOptions: CUDA graphs need in_place=True (state at fixed addresses). "
            "Fix: set cuda_graphs=False or in_place=True."
        )
    started = time.perf_counter()
    if use_graphs:
        log.info(
            "recir.lower_gpu: CUDA graphs on: the run-time id checks (recir::check_jagged) are dropped, "
            "they read ids on the host; validate batches before the step"
        )
    # A machine's first compile probes the CPU's SIMD ISAs (about 30 s on 2 cores): in a thread from here,
    # beside the lowering's Python passes, so code generation, its first reader, waits only for the rest.
    with (
        probe_in_background(recir_cache_dir())
        if dev.type == "cpu" and options.memoize_cpu_isa_probe
        else contextlib.nullcontext()
    ):
        return _lower(step, plan, dev, embedding_backend, options, started)


def _lower(
    step: StepGraph,
    plan: ShardingPlan | None,
    dev: torch.device,
    embedding_backend: str | None,
    options: GPUOptions,
    started: float,
) -> GPUCompiledStep | FusedTBECompiledStep:
    """compile()'s work after its checks: the lowering pipeline, then Inductor (and FBGEMM's TBE)."""
    # The lowering as code (recir.lower_gpu._pipeline.gpu_pipeline): every rewrite a Transform.
    pipeline = gpu_pipeline(step, options=options, plan=plan, device=dev, embedding_backend=embedding_backend)
    lowered = pipeline.run(step.copy())
    ir = pipeline.verified  # the last valid StepGraph (before the in-place epilogue)
    assert ir is not None
    backend = resolve_backend(embedding_backend, "gpu", dev)
    report = embedding_report(pipeline, backend, "gpu")
    cut = next((t for t in pipeline.transforms if isinstance(t, CutHostSplit)), None)
    for part in (ir, cut.split.step if cut is not None and cut.split is not None else None):
        if part is not None:
            part.meta["recir.embedding"] = report
    if options.in_place and any(
        r.name == InPlaceEpilogue.name and r.status == "disabled" for r in pipeline.records
    ):
        log.warning(
            "recir.lower_gpu: %s disabled (RECIR_DISABLE): state is returned, not updated in place",
            InPlaceEpilogue.name,
        )
        options = dataclasses.replace(options, in_place=False, cuda_graphs=False)
    dense = _inductor(lowered, ir, backend, dev, options, plan, pipeline, started)
    if cut is None or cut.split is None:
        return dense
    tbe = FusedTBE(cut.split, dev)
    return FusedTBECompiledStep(cut.split.step, cut.split, dense, tbe)


def _inductor(
    lowered: StepGraph,
    ir: StepGraph,
    backend: str,
    dev: torch.device,
    options: GPUOptions,
    plan: ShardingPlan | None,
    pipeline: Pipeline,
    started: float,
) -> GPUCompiledStep:
    """Inductor's ``compile_fx`` on the pipeline's output (``lowered``: with the in-place epilogue, the
    last IR ``ir`` without it) -> a GPUCompiledStep of ``ir``."""
    use_graphs = options.use_cuda_graphs(dev.type)
    gm = lowered.graph_module
    cache_dir = inductor_cache_dir(options.cache_dir)
    where = "CUDA" if dev.type == "cuda" else "the CPU device (no CUDA device in use)"
    log.info(
        "recir.lower_gpu: compiling a %d-node StepGraph with Inductor for %s (%s), mode %s, cache %s",
        len(ir.graph.nodes),
        where,
        dev,
        options.mode,
        cache_dir if options.cache else "off",
    )
    memo_isa = dev.type == "cpu" and options.memoize_cpu_isa_probe
    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    # Every change to torch's state lasts only for the compile (no global side effects).
    with (
        using_cache_dir(cache_dir),
        stable_cache_keys(),
        memoized_cpu_isa_probe(recir_cache_dir()) if memo_isa else contextlib.nullcontext(),
    ):
        regions = next((t for t in pipeline.transforms if isinstance(t, SplitRepeatedRegions)), None)
        # a recir-pipeline-sparse step whose next-batch collectives should overlap (Inductor's comm
        # reordering needs a process group: only where the graph has collectives)
        pipelined = any(slot.kind == "carry" for slot in ir.signature.state) and bool(collectives(gm))
        patches = options.inductor_patches(dev.type, pipelined=pipelined)
        direct: Path | bool = (
            False if options.use_aot_autograd(dev.type) else (cache_dir if options.cache else True)
        )
        try:
            if regions is not None and regions.split is not None and options.in_place:
                fn: Any = _compile_regions(
                    regions.split, ir, dev, fake_mode, patches, direct, options.batch_cpu_kernels
                )
            else:
                with kernels_built_at_end(options.batch_cpu_kernels):  # C++ kernels: one build per module
                    fn = _compile_fx(gm, _fake_inputs(ir, dev, fake_mode), fake_mode, patches, direct)
        except LoweringError:
            raise
        except Exception as exc:
            raise LoweringError(
                f"recir.lower_gpu: Inductor failed to compile the step for {dev}: "
                f"{type(exc).__name__}: {exc}\nFix: run the step eagerly (step(state, batch)) to check "
                "it, retry with GPUOptions(mode='default'), or report the op named above."
            ) from exc
    seconds = time.perf_counter() - started
    log.info("recir.lower_gpu: compiled in %.2f s", seconds)
    graphs = CudaGraphStep(fn, dev) if use_graphs else None
    return GPUCompiledStep(
        step=ir,
        device=dev,
        options=options,
        plan=plan,
        embedding_backend=backend,
        fn=fn,
        cuda_graph=graphs,
        compile_seconds=seconds,
        cache_dir=cache_dir,
        pipeline=pipeline,
    )
