"""Cached-history serving as two artifacts per stack, built from the captured step's serving graph:
`OUT.history` (a request batch -> every layer's history keys and values, the cache) and
`OUT.candidates` (the request batch and the cache -> logits), plus the manifest `OUT.json`.

The graphs come from `recir.transforms.cached_history` on `to_inference` of the training step captured
with every STU layer's attention as `recir::hstu_attention` (the last layer's too): the history graph
holds the history tokens' work, the candidate graph the candidates' rows only and their attention
against the cache. Each is exported as any serving StepGraph is (`recir.lower_gpu.export`: an
AOTInductor package for torch alone; `recir.lower_tpu` `export`: `jax.export` StableHLO for JAX alone),
the parameters baked in, every shape static (one artifact pair per users x candidates shape). The
candidate artifact reads the request batch's history fields only for per-user scalars (the query time,
the normaliser) and the candidates' ids; `load_cached_history(out)` returns the two callables.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from recir.transforms import CachedHistory, ConfigError, DataError

from ._model import DLRMv3

SERVING = "cached-history"
ENTRIES = ("history", "candidates")


def cached_history_graphs(
    model: DLRMv3,
    optimizers: Sequence[torch.optim.Optimizer],
    batch: Any,
    *,
    quantize: str | None = None,
    precision: str = "fp32",
    quantize_kernel: str = "aten",
) -> CachedHistory:
    """The history and candidate serving graphs of `model` at `batch`'s shapes (users x candidates):
    the training step captured with every layer's attention as the op (`recompute_attention_scores`,
    `candidates_only_last_layer = False`; the model is put back as it was), `to_inference`, then
    `recir.transforms.cached_history`; `export`'s serving pipeline (`quantize`, `precision`) on each."""
    from recir.capture import capture_train_step
    from recir.embedding import overrides
    from recir.transforms import cached_history, to_inference

    from ._export import serving_pipeline
    from ._model import loss_fn

    saved = (
        [layer.recompute_scores for layer in model.layers],
        model.candidates_only_last_layer,
        model.training,
    )
    model.recompute_attention_scores(True)
    model.candidates_only_last_layer = False
    model.train()  # capture traces the training step; to_inference drops dropout
    try:
        step = capture_train_step(model, optimizers, loss_fn, batch, overrides=overrides())
    finally:
        for layer, on in zip(model.layers, saved[0]):
            layer.recompute_scores = on
        model.candidates_only_last_layer = saved[1]
        model.train(saved[2])
    graphs = cached_history(to_inference(step))
    if quantize is None and precision == "fp32":
        return graphs
    history = serving_pipeline(quantize, precision, quantize_kernel).run(graphs.history)
    candidates = serving_pipeline(quantize, precision, quantize_kernel).run(graphs.candidates)
    return dataclasses.replace(graphs, history=history, candidates=candidates)


def export_cached_history(
    model: DLRMv3,
    optimizers: Sequence[torch.optim.Optimizer],
    batch: Any,
    target: str,
    out: str | os.PathLike[str],
    *,
    max_seq_len: int,
    quantize: str | None = None,
    precision: str = "fp32",
    quantize_kernel: str = "aten",
    extra: dict[str, Any] | None = None,
    platforms: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Write `model` (its parameters as trained) as the history and candidate artifacts for `target`
    (gpu|tpu) at `out`.history / `out`.candidates (`.pt2` on gpu), each with its stack's manifest, and
    the cached-history manifest `out`.json; returns the latter. `batch`: an example request (its users
    x candidates are the artifacts' shapes). `max_seq_len`: the attention normaliser a server pins for
    every request (`serving_max_len`); predict sets the batches' `max_seq_len` to it. `platforms`: the
    TPU stack's JAX platforms (`TPUCompiledStep.export`)."""
    from recir.distributed import write_atomically
    from recir.transforms import CACHED_HISTORY_KEY

    if target not in ("gpu", "tpu"):
        raise ConfigError(f"cached-history export: target must be gpu or tpu, got {target!r}")
    if precision not in ("fp32", "bf16"):
        raise ConfigError(f"cached-history export: precision must be fp32 or bf16, got {precision!r}")
    graphs = cached_history_graphs(
        model, optimizers, batch, quantize=quantize, precision=precision, quantize_kernel=quantize_kernel
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    entries: dict[str, Any] = {}
    for name, graph in zip(ENTRIES, (graphs.history, graphs.candidates)):
        path = Path(f"{out}.{name}" + (".pt2" if target == "gpu" else ""))
        tensors = graph.init_state(model, optimizers)
        if target == "gpu":
            from recir.lower_gpu import export

            written = export(graph, path, baked_state=tensors)
        else:
            from recir.lower_tpu import compile

            written = compile(graph).export(path, baked_state=tensors, platforms=platforms)
        entries[name] = {
            "file": path.name,
            "manifest": f"{path.name}.json",
            "inputs": written["batch"],
            "outputs": written["outputs"],
            "x64": bool(written.get("x64")),
        }
    users, count = batch.cand_actions.shape
    manifest = {
        "serving": SERVING,
        "target": target,
        "format": "AOTInductor packages (torch._inductor.aoti_load_package), (*batch[, *cache]) -> outputs"
        if target == "gpu"
        else "jax.export (StableHLO), exp.call(batch[ + cache]) -> outputs",
        "versions": {"torch": torch.__version__},
        "max_seq_len": max_seq_len,
        "users": int(users),
        "candidates": int(count),
        "precision": precision,
        "quantize": quantize or "none",
        "cache": list(graphs.cache),
        "graphs": graphs.history.meta[CACHED_HISTORY_KEY],
        "entries": entries,
        **(extra or {}),
    }
    write_atomically(f"{out}.json", json.dumps(manifest, indent=2, default=str))
    return manifest


def load_cached_history(out: str | os.PathLike[str]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(history, candidates) callables of the artifacts `export_cached_history` wrote at `out`, on torch
    tensors: `history(*batch_leaves) -> cache` (a tuple, the manifest's `cache` order) and
    `candidates(*batch_leaves, *cache) -> logits`; `batch_leaves` = `torch.utils._pytree.tree_leaves(batch)`
    of a request whose `max_seq_len` is the manifest's."""
    manifest_path = Path(f"{out}.json")
    if not manifest_path.is_file():
        raise DataError(f"{manifest_path}: no manifest. Fix: pass the --out of a cached-history export")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("serving") != SERVING:
        raise DataError(
            f"{manifest_path}: not a cached-history export (serving={manifest.get('serving')!r}). Fix: "
            "export with --serving cached-history"
        )
    entries = [manifest["entries"][n] for n in ENTRIES]
    paths = [manifest_path.parent / e["file"] for e in entries]
    if manifest["target"] == "gpu":
        importlib.import_module("torch._inductor.codecache")  # aoti_load_package uses it on torch 2.10
        packages = [torch._inductor.aoti_load_package(str(p)) for p in paths]

        def history_gpu(*leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(packages[0](*leaves))

        def candidates_gpu(*leaves: torch.Tensor) -> torch.Tensor:
            logits: torch.Tensor = packages[1](*leaves)[0]
            return logits

        return history_gpu, candidates_gpu
    import jax
    from jax import export as jax_export

    def wrap(path: Path, entry: dict[str, Any], single: bool) -> Callable[..., Any]:
        exp = jax_export.deserialize(bytearray(path.read_bytes()))
        dtypes = [b["dtype"] for b in entry["inputs"]]

        def call(*inputs: Any) -> Any:
            with jax.enable_x64(entry["x64"]):
                outs = exp.call([np.asarray(t).astype(d) for t, d in zip(inputs, dtypes)])
            got = tuple(torch.from_numpy(np.array(o)) for o in outs)
            return got[0] if single else got

        return call

    return wrap(paths[0], entries[0], False), wrap(paths[1], entries[1], True)
