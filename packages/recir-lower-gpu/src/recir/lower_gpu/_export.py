"""``export(step, path)``: a StepGraph as an AOTInductor package (``.pt2``) that runs with torch alone.

For serving: ``recir.transforms.to_inference(step)`` first. The embedding lookups are inlined as plain
ATen (recir-embedding's ``in_graph`` backend, no sparse updates, no run-time id checks), the graph is
moved to ``device`` and exported with ``torch.export``, and AOTInductor compiles it into one package.
Load it anywhere torch is: ``torch._inductor.aoti_load_package(path)(*state, *batch)`` returns the new
state then the outputs; the manifest beside it (``path`` + ``.json``) lists them. With ``baked_state``
the state is compiled into the package as constants and it is called ``(*batch) -> (*outputs)``.
Tables stored by ``QuantizeTables(kernel="fbgemm")`` are read by FBGEMM's inference TBE: such a package
needs ``import fbgemm_gpu`` before loading (the manifest's ``requires`` says so), RecIR still not.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from recir.transforms import INFERENCE_KEY, StepGraph
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ._compile import resolve_device
from ._cpp_codegen import CpuBf16Mode, CpuSigmoidMode, codegen_patches, cpp_codegen
from ._onednn import MIN_MACS, onednn_available
from ._prepare import copy_graph_module, retarget_devices
from ._variance import TwoPassVariance

log = logging.getLogger("recir.lower_gpu")

CpuMatmul = Literal["auto", "onednn", "aten"]


class _BakedState(nn.Module):
    """``gm`` with its state as buffers: ``forward(*batch) -> outputs``; torch.export lifts the buffers
    and AOTInductor compiles them into the package as constants."""

    def __init__(self, gm: nn.Module, state: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.gm = gm
        self.n_state = len(state)
        for i, t in enumerate(state):
            self.register_buffer(f"state_{i}", t)

    def forward(self, *batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state = [getattr(self, f"state_{i}") for i in range(self.n_state)]
        return tuple(self.gm(*state, *batch)[self.n_state :])


@contextlib.contextmanager
def _no_global_side_effects() -> Iterator[None]:
    """AOTInductor (torch 2.9) writes into the process's Inductor config (``aot_inductor.metadata``) and
    sets ``TORCHINDUCTOR_CACHE_DIR``: later compiles in the process would then key and cache differently
    from a fresh one (no FX-graph-cache hits across processes). Put both back."""
    from torch._inductor import config as inductor_config

    saved = inductor_config.save_config()
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        yield
    finally:
        inductor_config.load_config(saved)
        if env is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = env


@contextlib.contextmanager
def _int_arrays_keyed_by_buffer() -> Iterator[None]:
    """torch 2.10-2.12's AOTInductor C++ wrapper remembers each size and stride array it declared, keyed by
    ``id(writeline)``. That ``writeline`` is a bound method made afresh at every call, and a later one reuses
    the freed one's address, so an array declared in one part of the wrapper can be named again in another
    part that never declares it. The package's C++ build then fails (``'int_array_1' was not declared``;
    seen once in this package's tests, depending on addresses). For the block, the cache keys on the
    buffer the method writes to, as torch 2.13 does; torch 2.9 has no such cache and is left alone."""
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    original = CppWrapperCpu.__dict__.get("codegen_int_array_var")
    if original is None or not hasattr(CppWrapperCpu, "_codegen_int_array_var_impl"):
        yield
        return

    def codegen_int_array_var(
        self: Any, int_array: str, writeline: Any, known_statically: bool = False, graph: Any = None
    ) -> str:
        writes_to = getattr(writeline, "__self__", writeline)  # a bound method's buffer, else the callable
        key = (int_array, id(writes_to), known_statically, id(graph) if graph else None)
        cache = self.codegen_int_array_var_cache
        if key not in cache:
            cache[key] = self._codegen_int_array_var_impl(int_array, writeline, known_statically)
        return cache[key]

    CppWrapperCpu.codegen_int_array_var = codegen_int_array_var  # type: ignore[method-assign]
    try:
        yield
    finally:
        CppWrapperCpu.codegen_int_array_var = original  # type: ignore[method-assign]


class UnfuseCpuAddmm(CustomGraphPass):
    """An Inductor post-grad pass: each CPU ``addmm`` becomes a product, then the bias add.

    ATen's CPU ``addmm`` first copies the broadcast bias into its output and then accumulates the product
    into it; as a plain product, the addition fuses into the elementwise kernel Inductor generates after
    it. Inductor itself unfuses like this only on GPUs (``should_prefer_unfused_addmm``) and on the CPU
    folds ``mm`` + bias back into ``addmm`` in its post-grad patterns, so a rewrite before Inductor would
    be undone: this one runs after them (``post_grad_custom_post_pass``). Values: the same product and
    sum (equal to float rounding); ``beta=0`` ignores the bias (even NaN), as ``addmm`` does."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        aten = torch.ops.aten
        for node in list(graph.find_nodes(op="call_function", target=aten.addmm.default)):
            bias, a, b = node.args[:3]
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.device.type != "cpu":
                continue
            beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
            with graph.inserting_before(node):
                out = graph.call_function(aten.mm.default, (a, b))
                if alpha != 1:
                    out = graph.call_function(aten.mul.Tensor, (out, alpha))
                if beta != 0:
                    scaled = bias if beta == 1 else graph.call_function(aten.mul.Tensor, (bias, beta))
                    out = graph.call_function(aten.add.Tensor, (out, scaled))
            node.replace_all_uses_with(out)
            graph.erase_node(node)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


class OneDnnCpuMatmul(CustomGraphPass):
    """An Inductor post-grad pass: each CPU float32 ``mm`` of at least ``MIN_MACS`` multiply-adds as
    oneDNN's linear (``mkldnn._linear_pointwise``, in torch itself and in AOTInductor's C shim), the
    kernel ``GPUOptions(cpu_matmul="onednn")`` gives a training step (``recir::cpu_matmul``, which a
    package could not call without RecIR). ATen's ``mm`` runs MKL, whose fast path is Intel's only: on a
    2-core AMD EPYC (AVX-512), one thread, the serving model's products ran 1.05-1.71x faster through
    oneDNN (49664 x 64 @ 64 x 256: 27.0 against 18.3 ms). Values: the same product, to float rounding."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        aten = torch.ops.aten
        for node in list(graph.find_nodes(op="call_function", target=aten.mm.default)):
            a, b = node.args[:2]
            if not isinstance(a, torch.fx.Node) or not isinstance(b, torch.fx.Node):
                continue
            x, w = a.meta.get("val"), b.meta.get("val")  # (UnfuseCpuAddmm's products carry no "val")
            if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
                continue
            if x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32:
                continue
            (m, k), n = x.shape, w.shape[1]
            if m * k * n < MIN_MACS:
                continue
            with graph.inserting_before(node):
                weight = graph.call_function(aten.permute.default, (b, [1, 0]))
                weight.meta["val"] = w.permute(1, 0)
                out = graph.call_function(
                    torch.ops.mkldnn._linear_pointwise.default, (a, weight, None, "none", [], "")
                )
                out.meta["val"] = x.new_empty((m, n))
            node.replace_all_uses_with(out)
            graph.erase_node(node)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


class _Passes(CustomGraphPass):
    """Several custom passes in one of Inductor's slots, in order; keyed by their uuids."""

    def __init__(self, *passes: CustomGraphPass) -> None:
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Any:
        return tuple(p.uuid() for p in self.passes)


def _aoti_configs(
    program: torch.export.ExportedProgram,
    cpu_sigmoid: CpuSigmoidMode,
    cpu_matmul: CpuMatmul,
    cpu_bf16: CpuBf16Mode,
) -> dict[str, Any]:
    """Inductor settings for packaging ``program``: on the CPU, :class:`UnfuseCpuAddmm` after post-grad
    (then :class:`OneDnnCpuMatmul` unless ``cpu_matmul`` is ``"aten"`` or torch lacks oneDNN), short
    variances in two passes (``recir.lower_gpu._variance``, before post-grad), the sigmoid's
    exponential ``cpu_sigmoid`` and the bf16 rounding ``cpu_bf16`` (``recir.lower_gpu._cpp_codegen``).
    DLRMv3's full-sequence serving artifact at batch 256 (2-core Xeon, two alternating pairs): 288 / 327
    -> 254 / 263 ms (11 addmm per batch, each copying its bias first; 6% of the time in those copies)."""
    vals = [n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"]
    devices = {v.device.type for v in vals if isinstance(v, torch.Tensor)}
    if not devices <= {"cpu"}:
        return {}
    onednn = cpu_matmul == "onednn" or (cpu_matmul == "auto" and onednn_available())
    return {
        "post_grad_custom_pre_pass": TwoPassVariance(),
        "post_grad_custom_post_pass": _Passes(UnfuseCpuAddmm(), OneDnnCpuMatmul())
        if onednn
        else UnfuseCpuAddmm(),
        **codegen_patches(cpu_sigmoid, cpu_bf16),
    }


def package(
    program: torch.export.ExportedProgram,
    path: str | os.PathLike[str],
    *,
    cpu_sigmoid: CpuSigmoidMode = "fast",
    cpu_matmul: CpuMatmul = "auto",
    cpu_bf16: CpuBf16Mode = "native",
) -> Path:
    """AOTInductor-compile ``program`` into the package ``path`` (written atomically; a ``.pt2`` that
    loads with torch alone), leaving the process's Inductor config and environment as they were, so later
    compiles in this process key and cache as a fresh process does. On the CPU the bias of each
    ``linear``/``addmm`` is added after the product (:class:`UnfuseCpuAddmm`), ``cpu_matmul`` picks the
    float32 products' kernel (``GPUOptions.cpu_matmul``: oneDNN's linear, :class:`OneDnnCpuMatmul`, or
    ATen's BLAS call), ``cpu_sigmoid`` the sigmoid's exponential and ``cpu_bf16`` how float32 rounds to
    bfloat16 (``GPUOptions.cpu_sigmoid``, ``GPUOptions.cpu_bf16``). For programs exported by hand (e.g. an
    application's serving modules); :func:`export` does this for a StepGraph."""
    if cpu_matmul not in ("auto", "onednn", "aten"):
        raise ValueError(f"package: cpu_matmul must be 'auto', 'onednn' or 'aten', got {cpu_matmul!r}")
    configs = _aoti_configs(program, cpu_sigmoid, cpu_matmul, cpu_bf16)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written under its own name in a private directory beside the target, then moved over it: the
    # archive's entries are named after the file's stem, so they carry the target's name, not a temporary one.
    tmp_dir = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp = tmp_dir / (target.name if target.suffix == ".pt2" else f"{target.name}.pt2")
    try:
        tmp_dir.mkdir()
        with _no_global_side_effects(), cpp_codegen(configs), _int_arrays_keyed_by_buffer():
            torch._inductor.aoti_compile_and_package(program, package_path=str(tmp), inductor_configs=configs)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return target


def export(
    step: StepGraph,
    path: str | os.PathLike[str],
    *,
    device: Any = None,
    extra: Mapping[str, Any] | None = None,
    baked_state: Sequence[torch.Tensor] | None = None,
    cpu_sigmoid: CpuSigmoidMode = "fast",
    cpu_matmul: CpuMatmul = "auto",
    cpu_bf16: CpuBf16Mode = "native",
) -> dict[str, Any]:
    """Write ``step`` as an AOTInductor package to ``path`` (atomically) and a manifest beside it;
    returns the manifest. ``device``: CUDA when present, else the CPU (as ``compile``). ``extra``: more
    manifest fields (e.g. the application's options). ``baked_state``: the state values
    (``step.init_state(model)``) to compile into the package as constants; it then takes the batch
    alone and returns the outputs alone (the manifest's ``state`` is empty, ``baked_state`` lists them).
    ``cpu_sigmoid``, ``cpu_matmul``, ``cpu_bf16``: the CPU kernels' sigmoid exponential, float32 products
    and bf16 rounding (as ``GPUOptions``' options of those names; :func:`package`).
    """
    from recir.distributed import write_atomically
    from recir.embedding import QUANTIZE_KEY, lower_quantized_lookups, prepare_for_lowering

    dev = resolve_device(device)
    started = time.perf_counter()
    fbgemm = step.meta.get(QUANTIZE_KEY, {}).get("kernel") == "fbgemm"
    prepared = prepare_for_lowering(
        step,
        backend="in_graph",
        target="gpu",
        device=dev,
        sparse_updates=False,
        keep_checks=False,
        keep_quantized=fbgemm,
    )
    gm = copy_graph_module(prepared.graph_module)
    retarget_devices(gm, dev)
    requires: dict[str, str] = {}
    if fbgemm:
        lowered = lower_quantized_lookups(gm, dev)  # an ImportError naming the extra without FBGEMM
        import fbgemm_gpu

        requires["fbgemm_gpu"] = getattr(fbgemm_gpu, "__version__", "unknown")
        log.info("recir.lower_gpu: %d quantised lookup(s) call FBGEMM's inference TBE", lowered)
    sig = prepared.signature
    module: nn.Module = gm
    example = [torch.zeros(s.shape, dtype=s.dtype, device=dev) for s in sig.state]
    if baked_state is not None:
        sig.check_state(baked_state, "recir.lower_gpu.export(baked_state=)")
        module, example = _BakedState(gm, [t.detach().to(dev) for t in baked_state]), []
    example += [torch.zeros(b.shape, dtype=b.dtype, device=dev) for b in sig.batch]
    target = Path(path)
    with _no_global_side_effects():
        program = torch.export.export(module, tuple(example))
    package(program, target, cpu_sigmoid=cpu_sigmoid, cpu_matmul=cpu_matmul, cpu_bf16=cpu_bf16)

    def spec(name: str, shape: Any, dtype: torch.dtype) -> dict[str, Any]:
        return {"name": name, "shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}

    call = "(*batch) -> (*outputs)" if baked_state is not None else "(*state, *batch) -> (*state, *outputs)"
    first = (
        "import fbgemm_gpu and torch._inductor.codecache first"
        if fbgemm
        else ("import torch._inductor.codecache first on torch 2.10")
    )
    state = [spec(s.name, s.shape, s.dtype) for s in sig.state]
    manifest = {
        "format": f"AOTInductor package; torch._inductor.aoti_load_package(path){call} ({first})",
        "device": str(dev),
        "versions": {"torch": torch.__version__, **requires},
        "requires": sorted(requires),
        "state": [] if baked_state is not None else state,
        "baked_state": state if baked_state is not None else [],
        "batch": [spec(b.name, b.shape, b.dtype) for b in sig.batch],
        "outputs": [spec(o.name, o.shape, o.dtype) for o in sig.outputs],
        "meta": {k: v for k, v in step.meta.items() if k in (INFERENCE_KEY, QUANTIZE_KEY)},
        **(extra or {}),
    }
    write_atomically(f"{target}.json", json.dumps(manifest, indent=2, default=str))
    log.info("recir.lower_gpu: exported the step to %s in %.1f s", target, time.perf_counter() - started)
    return manifest
