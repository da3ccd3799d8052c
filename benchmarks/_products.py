"""The matrix products of a captured graph (``mm``, ``addmm``, ``bmm`` nodes): their floating-point
operations, and what they cost as bare calls on this CPU. Shared by benchmarks/dlrmv3.py (a training
step) and benchmarks/inference.py (a serving graph): the products alone at the kernels' own speed are a
floor under the whole graph's time, so they say how far a goal is from what this CPU can do at all."""

from __future__ import annotations

import statistics
import time
from typing import Any

_BARE: dict[tuple[Any, ...], float] = {}


def product_nodes(graph: Any) -> list[Any]:
    """The ``mm``, ``addmm`` and ``bmm`` nodes of ``graph`` (a torch.fx Graph), in order."""
    import torch

    aten = torch.ops.aten
    products = (aten.mm.default, aten.addmm.default, aten.bmm.default)
    return [n for n in graph.nodes if n.target in products]


def product_flops(nodes: list[Any]) -> float:
    """Floating-point operations of ``nodes`` (matrix products; 2 per multiply-add)."""
    import torch

    total = 0.0
    for node in nodes:
        a, b = (x.meta["val"] for x in node.args[-2:]) if node.target is torch.ops.aten.addmm.default else (
            x.meta["val"] for x in node.args[:2])  # fmt: skip
        total += 2 * a.numel() * b.shape[-1]
    return total


def _onednn(target: Any) -> Any:
    """``target`` (``mm`` or ``addmm``) as the GPU path's own float32 CPU product, oneDNN's GEMM
    (``recir::cpu_matmul``, registered by ``import recir.lower_gpu``); None for other products."""
    import recir.lower_gpu  # noqa: F401  (registers recir::cpu_matmul)
    import torch

    aten, matmul = torch.ops.aten, torch.ops.recir.cpu_matmul.default
    if target is aten.mm.default:
        return lambda a, b: matmul(a, b)
    if target is aten.addmm.default:
        return lambda bias, a, b: matmul(a, b, bias)
    return None


def _median_ms(fn: Any, operands: list[Any]) -> float:
    fn(*operands)  # warm-up: the library picks its kernel
    times = []
    for _ in range(3):
        started = time.perf_counter()
        fn(*operands)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def bare_ms(nodes: list[Any]) -> float:
    """Milliseconds ``nodes`` (matrix products) take as bare calls on this CPU: each distinct op, shape and
    dtype timed here on fresh contiguous operands with this process's threads (the median of 3), through
    ATen and, for float32 ``mm``/``addmm``, through oneDNN too (on AMD CPUs MKL, ATen's float32 GEMM, takes
    a slow path that oneDNN does not), the faster of the two."""
    import torch

    total = 0.0
    for node in nodes:
        vals = [a.meta["val"] for a in node.args if hasattr(a, "meta")]
        key = (node.target, torch.get_num_threads(), *((tuple(v.shape), v.dtype) for v in vals))
        if key not in _BARE:
            operands = [torch.randn(tuple(v.shape), dtype=v.dtype) for v in vals]
            kernels = [node.target]
            onednn = _onednn(node.target) if all(v.dtype == torch.float32 for v in vals) else None
            if onednn is not None:
                kernels.append(onednn)
            _BARE[key] = min(_median_ms(k, operands) for k in kernels)
        total += _BARE[key]
    return total
