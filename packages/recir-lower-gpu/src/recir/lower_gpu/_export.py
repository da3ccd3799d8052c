"""``export(step, path)``: a StepGraph as an AOTInductor package (``.pt2``) that runs with torch alone.

For serving: ``recir.transforms.to_inference(step)`` first. The embedding lookups are inlined as plain
ATen (recir-embedding's ``in_graph`` backend, no sparse updates, no run-time id checks), the graph is
moved to ``device`` and exported with ``torch.export``, and AOTInductor compiles it into one package.
Load it anywhere torch is: ``torch._inductor.aoti_load_package(path)(*state, *batch)`` returns the new
state then the outputs; the manifest beside it (``path`` + ``.json``) lists them. With ``baked_state``
the state is compiled into the package as constants and it is called ``(*batch) -> (*outputs)``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from recir.transforms import INFERENCE_KEY, StepGraph
from torch import nn

from ._compile import resolve_device
from ._prepare import copy_graph_module, retarget_devices

log = logging.getLogger("recir.lower_gpu")


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


def _product_then_bias(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.matmul(x, w.t())
    return out if b is None else out + b


def _addmm_as_mm_add(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1
) -> torch.Tensor:
    out = torch.mm(a, b)
    if alpha != 1:
        out = out * alpha
    if beta == 0:  # as addmm: the bias is ignored (even NaN)
        return out
    return out + (bias if beta == 1 else bias * beta)


def _on_cpu(program: torch.export.ExportedProgram) -> bool:
    vals = [n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"]
    devices = {v.device.type for v in vals if isinstance(v, torch.Tensor)}
    return devices <= {"cpu"}


def unfuse_bias_products(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``linear`` and ``addmm`` as a product, then the bias added, for a program that runs on the CPU.

    ATen's CPU ``addmm`` first copies the broadcast bias into its output and then accumulates the product
    into it; as a plain product, the addition fuses into the elementwise kernel Inductor generates after
    it (Inductor unfuses ``addmm`` like this only on GPUs). DLRMv3's cached-history candidate artifact at
    batch 256: 93.7 -> 86.7 ms. Values: the same product and sum (equal to float rounding). Programs on
    other devices are returned unchanged."""
    if not _on_cpu(program):
        return program
    return program.run_decompositions(
        {torch.ops.aten.linear.default: _product_then_bias, torch.ops.aten.addmm.default: _addmm_as_mm_add}
    )


def package(program: torch.export.ExportedProgram, path: str | os.PathLike[str]) -> Path:
    """AOTInductor-compile ``program`` into the package ``path`` (written atomically; a ``.pt2`` that
    loads with torch alone), leaving the process's Inductor config and environment as they were, so later
    compiles in this process key and cache as a fresh process does. On the CPU the bias of each
    ``linear``/``addmm`` is added after the product (:func:`unfuse_bias_products`). For programs exported
    by hand (e.g. an application's serving modules); :func:`export` does this for a StepGraph."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}.pt2")
    try:
        with _no_global_side_effects():
            program = unfuse_bias_products(program)
            torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def export(
    step: StepGraph,
    path: str | os.PathLike[str],
    *,
    device: Any = None,
    extra: Mapping[str, Any] | None = None,
    baked_state: Sequence[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Write ``step`` as an AOTInductor package to ``path`` (atomically) and a manifest beside it;
    returns the manifest. ``device``: CUDA when present, else the CPU (as ``compile``). ``extra``: more
    manifest fields (e.g. the application's options). ``baked_state``: the state values
    (``step.init_state(model)``) to compile into the package as constants; it then takes the batch
    alone and returns the outputs alone (the manifest's ``state`` is empty, ``baked_state`` lists them).
    """
    from recir.distributed import write_atomically
    from recir.embedding import QUANTIZE_KEY, prepare_for_lowering

    dev = resolve_device(device)
    started = time.perf_counter()
    prepared = prepare_for_lowering(
        step, backend="in_graph", target="gpu", device=dev, sparse_updates=False, keep_checks=False
    )
    gm = copy_graph_module(prepared.graph_module)
    retarget_devices(gm, dev)
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
    package(program, target)

    def spec(name: str, shape: Any, dtype: torch.dtype) -> dict[str, Any]:
        return {"name": name, "shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}

    call = "(*batch) -> (*outputs)" if baked_state is not None else "(*state, *batch) -> (*state, *outputs)"
    state = [spec(s.name, s.shape, s.dtype) for s in sig.state]
    manifest = {
        "format": f"AOTInductor package; torch._inductor.aoti_load_package(path){call} "
        "(import torch._inductor.codecache first on torch 2.10)",
        "device": str(dev),
        "versions": {"torch": torch.__version__},
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
