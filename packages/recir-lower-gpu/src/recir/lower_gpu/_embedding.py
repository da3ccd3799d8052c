"""Embedding backend selection for the GPU lowering (``embedding_backend=``), delegated to recir-embedding.

``recir.embedding.prepare_for_lowering`` applies sparse row-wise updates and the backend: ``fbgemm`` /
``torchrec`` keep lookups as override ops that Inductor calls as fallback kernels at graph boundaries;
``in_graph`` inlines the pure-ATen lookup so Inductor fuses it. Default: ``fbgemm`` on CUDA, else ``in_graph``.
"""

from __future__ import annotations

import torch
from recir.transforms import StepGraph


def apply_embedding_backend(
    step: StepGraph,
    backend: str | None,
    device: torch.device,
    *,
    sparse_updates: bool = True,
    keep_checks: bool | None = None,
) -> tuple[StepGraph, str]:
    """The step with ``backend`` applied for ``device`` (never mutates ``step``) and the backend's name.
    ``keep_checks=False`` drops the run-time id checks (they read ids on the host: no CUDA graphs)."""
    from recir.embedding import default_backend, prepare_for_lowering

    prepared = prepare_for_lowering(
        step,
        backend=backend,
        target="gpu",
        device=device,
        sparse_updates=sparse_updates,
        keep_checks=keep_checks,
    )
    report = prepared.meta.get("recir.embedding", {})
    return prepared, str(report.get("backend", backend or default_backend("gpu", device)))
