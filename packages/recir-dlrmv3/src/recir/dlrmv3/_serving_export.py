"""Cached-history serving as two artifacts per stack: `OUT.history` (a user's history -> the per-layer
key/value cache) and `OUT.candidates` (the cache and candidate ids -> logits), plus `OUT.json`.

GPU stack: two AOTInductor packages (torch alone), the candidate count dynamic (1..`max_candidates`).
TPU stack: two `jax.export` artifacts (JAX alone, x64 for the int64 ids), every shape static. The
parameters are compiled into both as constants. `load_cached_history(out)` returns the two callables.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from recir.transforms import ConfigError, DataError

from ._model import DLRMv3
from ._serving import CandidateScorer, HistoryEncoder, serving_max_len

SERVING = "cached-history"
ENTRIES = ("history", "candidates")


def _examples(model: DLRMv3, batch_size: int, num_candidates: int) -> dict[str, tuple[torch.Tensor, ...]]:
    cfg, n_ctx = model.config, len(model.spec.contextual)
    B, L = batch_size, cfg.uih_len
    ids = torch.ones(B, L, dtype=torch.int64)
    norm = torch.full((B,), serving_max_len(model), dtype=torch.int64)
    history = (ids, ids.clone(), ids.clone(), torch.full((B,), L, dtype=torch.int64),
               torch.ones(B, n_ctx, dtype=torch.int64), norm)  # fmt: skip
    with torch.no_grad():
        cache = HistoryEncoder(model)(*history)
    return {"history": history, "candidates": (*cache, torch.ones(B, num_candidates, dtype=torch.int64))}


def _spec(t: Any) -> dict[str, Any]:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def export_cached_history(
    model: DLRMv3,
    target: str,
    out: str | os.PathLike[str],
    *,
    batch_size: int,
    num_candidates: int,
    max_candidates: int = 4096,
    precision: str = "fp32",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write `model` (in `eval()`) as the history and candidate artifacts for `target` (gpu|tpu) at
    `out`.history / `out`.candidates and the manifest `out`.json; returns the manifest. The example
    shapes: `batch_size` users, `num_candidates` candidates each (the TPU artifacts keep them; on the
    GPU stack the candidate count may be anything in 1..`max_candidates`). `precision="bf16"`: every
    matrix product on bf16 copies of its fp32 operands, its result back in fp32 (`bf16_products`); the
    cache and every other op stay fp32."""
    from recir.distributed import write_atomically

    if target not in ("gpu", "tpu"):
        raise ConfigError(f"cached-history export: target must be gpu or tpu, got {target!r}")
    if precision not in ("fp32", "bf16"):
        raise ConfigError(f"cached-history export: precision must be fp32 or bf16, got {precision!r}")
    if not 1 <= num_candidates <= max_candidates:
        raise ConfigError(
            f"cached-history export: num_candidates {num_candidates} is outside 1..max_candidates "
            f"({max_candidates}). Fix: pass a candidate count in that range or raise max_candidates"
        )
    examples = _examples(model, batch_size, num_candidates)
    modules: dict[str, torch.nn.Module] = {
        "history": HistoryEncoder(model),
        "candidates": CandidateScorer(model),
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    entries: dict[str, Any] = {}
    for name in ENTRIES:
        path = Path(f"{out}.{name}" + (".pt2" if target == "gpu" else ""))  # aoti_load_package wants .pt2
        dynamic = None
        if target == "gpu" and name == "candidates":
            count = torch.export.Dim("candidates", min=1, max=max_candidates)
            dynamic = (None, None, None, None, {1: count})
        program = torch.export.export(modules[name], examples[name], dynamic_shapes=dynamic)
        if precision == "bf16":
            program = bf16_products(program)
        if target == "gpu":
            from recir.lower_gpu import package

            package(program, path)  # atomically, and without changing this process's Inductor config
        else:
            write_atomically(path, _jax_export(program, examples[name]))
        with torch.no_grad():
            outs = modules[name](*examples[name])
        outs = outs if isinstance(outs, tuple) else (outs,)
        entries[name] = {
            "file": path.name,
            "inputs": [_spec(t) for t in examples[name]],
            "outputs": [_spec(t) for t in outs],
        }
    manifest = {
        "serving": SERVING,
        "target": target,
        "format": "AOTInductor packages (torch._inductor.aoti_load_package)"
        if target == "gpu"
        else "jax.export (StableHLO), exp.call(*inputs), x64",
        "versions": {"torch": torch.__version__},
        "max_seq_len": serving_max_len(model),
        "precision": precision,
        "dynamic_candidates": [1, max_candidates] if target == "gpu" else None,
        "entries": entries,
        **(extra or {}),
    }
    write_atomically(f"{out}.json", json.dumps(manifest, indent=2))
    return manifest


def _low(t: Any) -> Any:
    return t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t


def _product_in_bf16(op: Any) -> Callable[..., Any]:
    def product(*args: Any, **kwargs: Any) -> Any:
        if not any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args):
            return NotImplemented  # already bf16 (the call below): the op itself
        return op(*(_low(a) for a in args), **kwargs).to(torch.float32)

    return product


def _linear_in_bf16(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    rows = _low(x).reshape(-1, x.shape[-1])
    out = torch.ops.aten.mm.default(rows, _low(w).t()).to(torch.float32).reshape(*x.shape[:-1], w.shape[0])
    return out if b is None else out + b


def bf16_products(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """`program` with every `linear`/`matmul`/`mm`/`bmm` on bf16 copies of its fp32 operands and its result
    cast back to fp32 (the bias added in fp32): what recir-mixed-precision does to a StepGraph's forward
    products, for the hand-written serving modules. The casts of baked weights stay in the program (whether
    a compiler folds them into bf16 constants was not checked; the weights are small next to the
    activations here)."""
    aten = torch.ops.aten
    table: dict[Any, Callable[..., Any]] = {
        op: _product_in_bf16(op) for op in (aten.matmul.default, aten.mm.default, aten.bmm.default)
    }
    table[aten.linear.default] = _linear_in_bf16
    return program.run_decompositions(table)


def _jax_export(program: torch.export.ExportedProgram, example: tuple[torch.Tensor, ...]) -> bytes:
    import jax
    from jax import export as jax_export
    from torchax.export import exported_program_to_jax

    with jax.enable_x64(True):
        weights, fn = exported_program_to_jax(program)

        def serve(*inputs: Any) -> Any:
            return fn(weights, inputs)  # closed over: StableHLO constants

        shapes = [
            jax.ShapeDtypeStruct(tuple(t.shape), np.dtype(str(t.dtype).removeprefix("torch.")))
            for t in example
        ]
        return bytes(jax_export.export(jax.jit(serve))(*shapes).serialize())


def load_cached_history(out: str | os.PathLike[str]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(history, candidates) callables of the artifacts `export_cached_history` wrote at `out`: torch
    tensors in (in each entry's manifest order), a tuple of torch tensors (history) or logits out."""
    manifest_path = Path(f"{out}.json")
    if not manifest_path.is_file():
        raise DataError(f"{manifest_path}: no manifest. Fix: pass the --out of a cached-history export")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("serving") != SERVING:
        raise DataError(
            f"{manifest_path}: not a cached-history export (serving={manifest.get('serving')!r}). Fix: "
            "export with --serving cached-history"
        )
    paths = [manifest_path.parent / manifest["entries"][n]["file"] for n in ENTRIES]
    if manifest["target"] == "gpu":
        importlib.import_module("torch._inductor.codecache")  # aoti_load_package uses it on torch 2.10

        hist, cand = (torch._inductor.aoti_load_package(str(p)) for p in paths)
        return hist, cand
    import jax
    from jax import export as jax_export

    def wrap(path: Path) -> Callable[..., Any]:
        exp = jax_export.deserialize(bytearray(path.read_bytes()))

        def call(*inputs: Any) -> Any:
            with jax.enable_x64(True):
                outs = exp.call(*[np.asarray(t) for t in inputs])
            outs = [torch.from_numpy(np.array(o)) for o in outs]
            return tuple(outs) if len(outs) > 1 else outs[0]

        return call

    return wrap(paths[0]), wrap(paths[1])
