"""``compile(step)``: lower a StepGraph with Inductor (CUDA when present, else the CPU device).

The graph is given to Inductor's ``compile_fx`` (AOTAutograd + Inductor, no Dynamo re-trace) with an
in-place epilogue, under a fake mode with a shape env so the FX graph and AOTAutograd caches apply.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from recir.transforms import ConfigError, LoweringError, StepGraph, verify, verify_level
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ._cache import inductor_cache_dir, recir_cache_dir, stable_cache_keys, using_cache_dir
from ._cudagraph import CudaGraphStep
from ._distributed import distribute_for_lowering
from ._embedding import apply_embedding_backend
from ._fused_tbe import FusedTBECompiledStep
from ._isa import memoized_cpu_isa_probe
from ._options import GPUOptions
from ._prepare import add_in_place_epilogue, check_kernels, copy_graph_module, retarget_devices
from ._private_apis import check_private_apis
from ._step import GPUCompiledStep
from ._store import register_inductor_lowering, store_rng_masks

log = logging.getLogger("recir.lower_gpu")

_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


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


def _collectives(gm: fx.GraphModule) -> list[fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target.namespace in _COLLECTIVE_NAMESPACES
    ]


def _check_distributed(gm: fx.GraphModule, plan: Any) -> None:
    collectives = _collectives(gm)
    if collectives and not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"recir.lower_gpu: the step has {len(collectives)} collective(s) (first: %{collectives[0].name}, "
            f"{collectives[0].target}) {'from the plan ' if plan is not None else ''}but no torch.distributed "
            "process group is initialised. Fix: launch with torchrun and call "
            "torch.distributed.init_process_group() (nccl on CUDA, gloo on CPU) before compiling."
        )


def _fake_inputs(step: StepGraph, device: torch.device, fake_mode: FakeTensorMode) -> list[torch.Tensor]:
    specs = [(s.shape, s.dtype) for s in step.signature.state] + [
        (b.shape, b.dtype) for b in step.signature.batch
    ]
    with fake_mode:
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]


def _compile_fx(gm: fx.GraphModule, example: list[torch.Tensor], fake_mode: FakeTensorMode, patches: dict):
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    context = torch._guards.TracingContext(fake_mode)
    with (
        inductor_config.patch(patches),
        functorch_config.patch(enable_autograd_cache=bool(patches.get("fx_graph_cache", True))),
        torch._guards.tracing(context),
    ):
        return compile_fx(gm, example)


def compile(
    step: StepGraph,
    plan: Any = None,
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
    # With a plan, lower this rank's program (collectives as graph nodes); a distributed step passes through.
    step = distribute_for_lowering(step, plan)
    if step.dynamic:
        raise LoweringError(
            "recir.lower_gpu: dynamic StepGraphs are not lowered yet (the GPU path compiles static "
            "shapes). Fix: capture with mode='static' and pad or bucket batches to fixed shapes."
        )
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
    keep_checks = False if use_graphs else None
    fused = _prepare_fused_tbe(step, embedding_backend, dev, options, keep_checks, plan)
    if fused is not None:
        return _compile_fused_tbe(fused, dev, options, plan, started)
    prepared, backend = apply_embedding_backend(
        step, embedding_backend, dev, sparse_updates=options.sparse_updates, keep_checks=keep_checks
    )
    return _compile_prepared(prepared, backend, dev, options, plan, started)


def _prepare_fused_tbe(
    step: StepGraph,
    backend: str | None,
    dev: torch.device,
    options: GPUOptions,
    keep_checks: bool | None,
    plan: Any,
) -> StepGraph | None:
    """The step prepared for FBGEMM's fused TBE (the tables it can train marked for the split), or None
    when the fbgemm backend is not asked for, or no table can be fused (the log says why)."""
    from recir.embedding import default_backend, fused_tbe_tables, prepare_for_lowering

    if (backend or default_backend("gpu", dev)) != "fbgemm" or not options.fused_tbe:
        return None
    why = None
    if not options.sparse_updates:
        why = "GPUOptions(sparse_updates=False) keeps every table's dense update"
    elif "recir.optimizer" not in step.meta:
        why = "the step has no captured optimizer (meta 'recir.optimizer')"
    elif plan is not None or _collectives(step.graph_module):
        why = "the step is distributed (a sharding plan): the fused TBE runs single-process here"
    if why is not None:
        log.info("recir.lower_gpu: FBGEMM's forward kernel in the graph, not the fused TBE: %s", why)
        return None
    kw = {"backend": "fbgemm", "target": "gpu", "device": dev, "keep_checks": keep_checks}
    marked = prepare_for_lowering(step, host_tables=True, **kw)
    tables, reasons = fused_tbe_tables(marked)
    for slot, reason in reasons.items():
        log.info(
            "recir.lower_gpu: table %s keeps FBGEMM's forward kernel and the in-graph row update, "
            "not the fused TBE: %s",
            slot,
            reason,
        )
    if not tables:
        return None
    return marked if not reasons else prepare_for_lowering(step, host_tables=tables, **kw)


def _compile_fused_tbe(
    marked: StepGraph, dev: torch.device, options: GPUOptions, plan: Any, started: float
) -> FusedTBECompiledStep:
    """Cut the step at its tables, compile the dense part with Inductor, train the tables with TBE."""
    from recir.embedding import FusedTBE, split_host

    split = split_host(marked)
    if verify_level() >= 1:
        for name, part in (("lookup", split.lookup), ("dense", split.device), ("update", split.update)):
            verify(part, transform=f"recir.embedding.split_host ({name} part)")
    tbe = FusedTBE(split, dev)
    dense = _compile_prepared(split.device, "fbgemm", dev, options, plan, started)
    return FusedTBECompiledStep(marked, split, dense, tbe)


def _compile_prepared(
    prepared: StepGraph, backend: str, dev: torch.device, options: GPUOptions, plan: Any, started: float
) -> GPUCompiledStep:
    use_graphs = options.use_cuda_graphs(dev.type)
    gm = copy_graph_module(prepared.graph_module)
    if options.store_rng_masks:
        register_inductor_lowering()
        stored = store_rng_masks(gm)
        if stored:
            log.info("recir.lower_gpu: %d dropout mask(s) stored once, not recomputed per reader", stored)
    retarget_devices(gm, dev)
    _check_distributed(gm, plan)
    check_kernels(gm, dev)
    num_state = len(prepared.signature.state)
    if options.in_place:
        gm = add_in_place_epilogue(gm, num_state)
    cache_dir = inductor_cache_dir(options.cache_dir)
    where = "CUDA" if dev.type == "cuda" else "the CPU device (no CUDA device in use)"
    log.info(
        "recir.lower_gpu: compiling a %d-node StepGraph with Inductor for %s (%s), mode %s, cache %s",
        len(prepared.graph.nodes),
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
        try:
            fn = _compile_fx(
                gm, _fake_inputs(prepared, dev, fake_mode), fake_mode, options.inductor_patches(dev.type)
            )
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
        step=prepared,
        device=dev,
        options=options,
        plan=plan,
        embedding_backend=backend,
        fn=fn,
        cuda_graph=graphs,
        compile_seconds=seconds,
        cache_dir=cache_dir,
    )
