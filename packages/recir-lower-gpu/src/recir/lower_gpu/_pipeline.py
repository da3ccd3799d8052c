"""The GPU lowering as a pipeline of Transforms, built in one place: :func:`gpu_pipeline`.

Every rewrite between capture's output and Inductor's input is a registered Transform, so each gets
verification, provenance, timings, ``RECIR_DUMP_DIR`` dumps and ``RECIR_DISABLE`` bisection, and
``compiled.pipeline.report()`` lists them. The builder makes every choice (backend, fused tables,
checks, device) and passes it to the transforms as options; the transforms read no environment.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.fx as fx
from recir.distributed import ShardingPlan
from recir.transforms import (
    OPTIMIZER_KEY,
    RECOMPUTE_KEY,
    ConfigError,
    InlineReferences,
    Pipeline,
    StepGraph,
    Transform,
    TransformResult,
    register_transform,
)

from ._distributed import distribute_for_lowering
from ._onednn import OVERRIDE, onednn_available, route_matmuls
from ._options import GPUOptions
from ._prepare import add_in_place_epilogue, check_kernels, copy_graph_module, retarget_devices
from ._regions import RegionSplit
from ._store import expand_recompute_barriers, register_inductor_lowering, store_rng_masks, store_shared_masks

log = logging.getLogger("recir.lower_gpu")
_HSTU_ATTENTION = (torch.ops.recir.hstu_attention.default, torch.ops.recir.hstu_attention_backward.default)


def _qualname(target: object) -> str | None:
    return target._schema.name if isinstance(target, torch._ops.OpOverload) else None


_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def collectives(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's collective nodes (``_c10d_functional`` ops a recir.distributed plan inserts)."""
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target.namespace in _COLLECTIVE_NAMESPACES
    ]


@register_transform
class DistributeForLowering(Transform):
    """With a recir.distributed ShardingPlan, this rank's program: the plan's collectives as graph nodes
    (``recir.distributed.distribute``). A step that is already distributed, or no plan: unchanged."""

    name = "recir-gpu-distribute-step"
    summary = "this rank's program under the sharding plan (collectives as graph nodes)"

    @dataclasses.dataclass(frozen=True)
    class Options:
        plan: ShardingPlan | None = None

    def run(self, step: StepGraph) -> TransformResult:
        out = distribute_for_lowering(step, self.options.plan)
        return TransformResult(out, out is not step, {"collectives": len(collectives(out.graph_module))})


@register_transform
class StoreRngMasks(Transform):
    """Compute each dropout keep mask once and store it (``recir::store``) instead of letting Inductor
    recompute its counter hash in every kernel that reads it (``GPUOptions.store_rng_masks``)."""

    name = "recir-gpu-store-rng-masks"
    summary = "route reads of dropout masks through recir::store (computed once, stored)"

    def run(self, step: StepGraph) -> TransformResult:
        register_inductor_lowering()
        stored = store_rng_masks(step.graph_module)
        if stored:
            log.info("recir.lower_gpu: %d dropout mask(s) stored once, not recomputed per reader", stored)
        return TransformResult(step, bool(stored), {"masks": stored})


@register_transform
class StoreSharedMasks(Transform):
    """Compute once, and store as bytes, every large boolean value that three or more kernels read
    (``GPUOptions.store_shared_masks``): an attention mask built once per step and read by every layer's
    forward and backward was otherwise recomputed (int64 position compares) inside each of them::

        %mask = and(%causal, %valid)            %mask = and(%causal, %valid)
        ... 20 readers of %mask              -> %stored = recir.store(%mask); ... 20 readers of %stored
    """

    name = "recir-gpu-store-shared-masks"
    summary = "compute large boolean values read by 3+ kernels once (recir::store)"

    def run(self, step: StepGraph) -> TransformResult:
        register_inductor_lowering()
        stored = store_shared_masks(step.graph_module)
        return TransformResult(step, bool(stored), {"masks": stored})


@register_transform
class ExpandRecomputeBarriers(Transform):
    """recir-recompute-activations' barriers as plain ATen (each entry ORs in a zero read from the backward
    value the copies wait for): Inductor then neither computes the copies early nor fuses them into
    their forward twins."""

    name = "recir-gpu-expand-recompute-barriers"
    summary = "recompute barriers as ATen data dependencies on the backward"

    def run(self, step: StepGraph) -> TransformResult:
        expanded = expand_recompute_barriers(step.graph_module)
        return TransformResult(step, bool(expanded), {"barriers": expanded})


@register_transform
class RetargetDevices(Transform):
    """``device=`` arguments (factory ops, ``_to_copy``) and tensor constants moved to the target device."""

    name = "recir-gpu-retarget-devices"
    summary = "move device= arguments and tensor constants to the compile device"

    @dataclasses.dataclass(frozen=True)
    class Options:
        device: str = "cpu"

    def run(self, step: StepGraph) -> TransformResult:
        moved = retarget_devices(step.graph_module, torch.device(self.options.device))
        return TransformResult(step, bool(moved), {"retargeted": moved})


@register_transform
class OneDNNMatmul(Transform):
    """``GPUOptions(cpu_matmul=...)`` on the CPU device: fp32 ``mm``/``addmm`` of at least 4M
    multiply-adds run by oneDNN's GEMM (``recir::cpu_matmul``, recir.lower_gpu._onednn) instead of
    ATen's BLAS call, whose MKL is slow on non-Intel CPUs (2.1-2.5x on an AMD EPYC)::

        %mm = aten.mm(%x, %t)                 ->  %mm = recir.cpu_matmul(%x, %t, None)
        %o = aten.addmm(%b, %x, %t)           ->  %o = recir.cpu_matmul(%x, %t, %b)
    """

    name = OVERRIDE
    summary = "fp32 matrix products on the CPU device through oneDNN's GEMM"

    def run(self, step: StepGraph) -> TransformResult:
        counts = route_matmuls(step.graph_module)
        return TransformResult(step, bool(counts["mm"] or counts["addmm"]), counts)


@register_transform
class CheckKernels(Transform):
    """No rewrite: every op must have an Inductor lowering/decomposition or a kernel for the device, and
    collectives need an initialised process group. ``LoweringError``/``ConfigError`` name the node."""

    name = "recir-gpu-check-kernels"
    summary = "check every op can be compiled or called on the device (no rewrite)"

    @dataclasses.dataclass(frozen=True)
    class Options:
        device: str = "cpu"
        planned: bool = False  # the step came with a sharding plan (only for the error's wording)

    def run(self, step: StepGraph) -> TransformResult:
        found = collectives(step.graph_module)
        if found and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ConfigError(
                f"recir.lower_gpu: the step has {len(found)} collective(s) (first: %{found[0].name}, "
                f"{found[0].target}) {'from the plan ' if self.options.planned else ''}but no torch.distributed "
                "process group is initialised. Fix: launch with torchrun and call "
                "torch.distributed.init_process_group() (nccl on CUDA, gloo on CPU) before compiling."
            )
        check_kernels(step.graph_module, torch.device(self.options.device))
        return TransformResult(step, False, {})


@register_transform
class SplitRepeatedRegions(Transform):
    """``GPUOptions(regions="repeated")``: plan the step's cut into pieces at its repeated module
    instances (recir.lower_gpu._regions). The graph is not rewritten: the split is kept on the transform
    (``self.split``) and the compile then gives Inductor each distinct piece once; disabled
    (``RECIR_DISABLE``) or a step it cannot cut (``self.split`` None, the reason in the stats): whole::

        forward [glue][layers.0]..[layers.4][glue], backward .., optimizer ..   ->  stats pieces=20, distinct=9
    """

    name = "recir-gpu-repeated-regions"
    summary = "cut the step at repeated module instances; each distinct piece is compiled once"

    def __init__(self, options: object | None = None, **kwargs: object) -> None:
        super().__init__(options, **kwargs)
        self.split: RegionSplit | None = None

    def run(self, step: StepGraph) -> TransformResult:
        split = RegionSplit(step.graph_module, len(step.signature.state))
        if split.reason is not None:
            log.info("recir.lower_gpu: regions='repeated' compiles the step whole: %s", split.reason)
            self.split = None
            return TransformResult(step, False, {"whole": split.reason})
        self.split = split
        return TransformResult(
            step,
            False,
            {"pieces": len(split.pieces), "distinct": len(set(split.codes)), "hoisted": split.hoisted},
        )


@register_transform
class InPlaceEpilogue(Transform):
    """``(state, batch) -> (new_state, outputs)`` becomes ``(state, batch) -> outputs`` that ``copy_``s each
    new state into its input, which Inductor fuses into the kernel computing it (no second persistent
    copy of the state). The backend's calling convention, not IR: it comes last and is not verified::

        return (%w1, %loss)                       # before
        copy_(%w, %w1); return (%loss,)           # after
    """

    name = "recir-gpu-in-place-epilogue"
    summary = "write each new state into its input with copy_ (Inductor's calling convention)"
    execution_form = True

    def run(self, step: StepGraph) -> TransformResult:
        gm = add_in_place_epilogue(copy_graph_module(step.graph_module), len(step.signature.state))
        copies = sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default)
        return TransformResult(step.replace(graph_module=gm), True, {"copies": copies})


def gpu_pipeline(
    step: StepGraph,
    *,
    options: GPUOptions,
    plan: ShardingPlan | None,
    device: torch.device,
    embedding_backend: str | None,
) -> Pipeline:
    """The GPU lowering of ``step`` as a Pipeline, every choice made here:

    1. this rank's program under ``plan`` (collectives as graph nodes);
    2. recir-embedding's transforms: sparse row-wise table updates, then the backend's kernels; with the
       ``fbgemm`` backend and ``GPUOptions(fused_tbe=True)``, the tables FBGEMM's TBE can train are
       marked and the step is cut at the embedding boundary (``recir-embed-cut-host-split``): what
       follows compiles only the device part, and TBE runs the tables around it; ``recir::hstu_attention``
       and its backward inlined as their ATen references (Inductor generates their kernels), or with
       ``GPUOptions(hstu_attention="triton")`` on CUDA retargeted to RecIR's fused Triton kernels;
    3. dropout masks stored once (``GPUOptions.store_rng_masks``; by default when the step recomputes
       activations), and boolean values many kernels read,
       such as an attention mask (``GPUOptions.store_shared_masks``);
    4. device arguments and constants moved to ``device``;
    5. on the CPU device, fp32 matrix products through oneDNN (``GPUOptions.cpu_matmul``);
    6. the kernel check (nothing rewritten);
    7. with ``GPUOptions(regions="repeated")`` (and in place), the cut into repeated regions (planned,
       nothing rewritten);
    8. the in-place epilogue (``GPUOptions.in_place``): what Inductor receives.
    """
    from recir.embedding import CutHostSplit, checks_enabled, embedding_transforms, resolve_backend

    use_graphs = options.use_cuda_graphs(device.type)
    transforms: list[Transform] = [DistributeForLowering(plan=plan)]
    if any(_qualname(n.target) == "recir::counter_uniform" for n in step.graph.nodes):
        # the counter hash of each random op as its int64 ATen reference, which Inductor fuses into the
        # kernels that read it (dropout's masks) and which the rewrites below read as they always did
        transforms.append(InlineReferences(ops=("recir::counter_uniform",)))
    backend = resolve_backend(embedding_backend, "gpu", device)
    fused = _fused_tables(step, backend, device, options, plan)
    embedding = embedding_transforms(
        step,
        backend=backend,
        target="gpu",
        # the run-time id checks read ids on the host: not inside a CUDA graph
        keep_checks=not use_graphs and checks_enabled(),
        sparse_updates=options.sparse_updates,
        host_tables=fused or False,
    )
    transforms += embedding
    if fused:
        transforms.append(CutHostSplit())
    attention = [n for n in step.graph.nodes if n.target in _HSTU_ATTENTION]
    if attention and options.hstu_attention == "triton":
        if device.type != "cuda":
            raise ConfigError(
                f"GPUOptions(hstu_attention='triton') runs Triton kernels on a CUDA device; this step lowers "
                f"for {device}. Fix: hstu_attention='inductor' (the default) on the CPU device."
            )
        from ._hstu_triton import TritonAttention

        transforms.append(TritonAttention())
    elif attention:
        # Inductor generates the attention's kernels from its ATen reference (fused around the products);
        # the backward reference reads its recomputed scores through a recompute barrier
        transforms.append(InlineReferences(ops=tuple(op._schema.name for op in _HSTU_ATTENTION)))
    barriers = [n for n in step.graph.nodes if n.target is torch.ops.recir.recompute_barrier.default]
    # recomputed activations (recir-recompute-activations' copies), not a model's own barriers (a custom
    # backward recomputing what it did not keep, such as DLRMv3's attention scores)
    recomputes = any(RECOMPUTE_KEY in n.meta for n in barriers)
    if options.store_rng_masks or (options.store_rng_masks is None and recomputes):
        transforms.append(StoreRngMasks())
    if options.store_shared_masks:
        transforms.append(StoreSharedMasks())
    if barriers or attention:
        transforms.append(ExpandRecomputeBarriers())
    transforms.append(RetargetDevices(device=str(device)))
    if _onednn_matmuls(options, device):
        transforms.append(OneDNNMatmul())
    transforms.append(CheckKernels(device=str(device), planned=plan is not None))
    if options.in_place:
        if options.regions == "repeated":
            transforms.append(SplitRepeatedRegions())
        transforms.append(InPlaceEpilogue())
    return Pipeline(transforms, name="recir.lower_gpu")


def _onednn_matmuls(options: GPUOptions, device: torch.device) -> bool:
    if device.type != "cpu" or options.cpu_matmul == "aten":
        return False
    if onednn_available():
        return True
    if options.cpu_matmul == "onednn":
        raise ConfigError(
            "GPUOptions(cpu_matmul='onednn'): this torch build has no oneDNN (torch.backends.mkldnn is "
            "unavailable). Fix: use cpu_matmul='auto' or 'aten', or a torch build with oneDNN (the PyPI "
            "wheels for x86-64 and aarch64 have it)."
        )
    return False


def _fused_tables(
    step: StepGraph, backend: str, device: torch.device, options: GPUOptions, plan: ShardingPlan | None
) -> list[str]:
    """The tables FBGEMM's fused TBE trains (none unless the fbgemm backend and ``fused_tbe``); logs why
    each other table, or the whole step, keeps the in-graph update."""
    from recir.embedding import fused_tbe_tables, prepare_for_lowering

    if backend != "fbgemm" or not options.fused_tbe:
        return []
    why = None
    if not options.sparse_updates:
        why = "GPUOptions(sparse_updates=False) keeps every table's dense update"
    elif OPTIMIZER_KEY not in step.meta:
        why = f"the step has no captured optimizer (meta {OPTIMIZER_KEY!r})"
    elif plan is not None or collectives(step.graph_module):
        why = "the step is distributed (a sharding plan): the fused TBE runs single-process here"
    if why is not None:
        log.info("recir.lower_gpu: FBGEMM's forward kernel in the graph, not the fused TBE: %s", why)
        return []
    marked = prepare_for_lowering(step, backend="fbgemm", target="gpu", device=device, host_tables=True)
    tables, reasons = fused_tbe_tables(marked)
    for slot, reason in reasons.items():
        log.info(
            "recir.lower_gpu: table %s keeps FBGEMM's forward kernel and the in-graph row update, "
            "not the fused TBE: %s",
            slot,
            reason,
        )
    return tables
