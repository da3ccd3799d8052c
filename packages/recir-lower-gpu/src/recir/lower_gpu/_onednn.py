"""fp32 matrix products on the CPU device through oneDNN instead of ATen's BLAS call.

On the CPU, ATen runs an fp32 ``mm``/``addmm`` through the BLAS library torch was built with (MKL in the
PyPI wheels), and Inductor calls that same kernel (``extern_kernels.mm``). MKL picks its fast code path
only on Intel CPUs: on an AMD EPYC with AVX-512 (Zen 4) a 1048x512 @ 512x2048 product took 11-14 ms
through ``torch.mm`` and 5.2-6.7 ms through oneDNN's ``mkldnn._linear_pointwise`` (every operand
layout of a training step: ``x @ W^T``, ``dY @ W``, ``dY^T @ x``; XLA's CPU backend: 5.9 ms).
``recir::cpu_matmul(a, b, bias)`` is ``a @ b (+ bias)`` run by oneDNN; Inductor calls it as an
opaque kernel, like the BLAS call it replaces. Results equal ATen's up to the summation order
(fp32 rounding, about 1e-6 relative).

Inductor's own oneDNN linear lowering needs frozen (constant) weights, an inference-only mode, so the
op is a ``torch.library.custom_op`` here.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from recir.transforms import OVERRIDE_KEY, register_override_op
from torch import Tensor

OVERRIDE = "recir-gpu-onednn-matmul"

# Products below this many multiply-adds stay ATen's: oneDNN's call overhead (a Python custom op,
# a cached primitive) is tens of microseconds, what a small product costs in total.
MIN_MACS = 1 << 22


@torch.library.custom_op("recir::cpu_matmul", mutates_args=())
def cpu_matmul(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """``a @ b + bias`` (``a`` [M, K], ``b`` [K, N], ``bias`` [N] or None) by oneDNN's fp32 GEMM."""
    return torch.ops.mkldnn._linear_pointwise.default(a, b.t(), bias, "none", [], "")


@cpu_matmul.register_fake
def _cpu_matmul_fake(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    return a.new_empty((a.shape[0], b.shape[1]))


register_override_op("recir::cpu_matmul", OVERRIDE)


def onednn_available() -> bool:
    """True when this torch has oneDNN (``torch.backends.mkldnn``) and its linear kernel."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _rows(x: Tensor) -> bool:
    """``x`` (2-D) has unit stride along its last dimension (rows of contiguous elements)."""
    return x.stride(1) == 1 or x.shape[1] == 1


def _transposed(a: Tensor, b: Tensor) -> bool:
    """Whether ``a @ b`` is better computed as ``(b^T @ a^T)^T``. oneDNN's linear reads its input (the
    left operand) as rows and copies any other layout (its weight may have any strides), so take the
    product whose left operand already is rows, else the one that copies the smaller operand: a
    gradient ``dW = dY^T @ x`` then copies ``x``, not the larger ``dY`` (and comes out transposed)."""
    if _rows(a):
        return False
    return _rows(b.t()) or b.numel() < a.numel()


def _fp32(node: object) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, Tensor) and val.dtype == torch.float32


def route_matmuls(gm: fx.GraphModule, min_macs: int = MIN_MACS) -> dict[str, int]:
    """Rewrite every fp32 ``aten.mm`` and ``aten.addmm`` (1-D bias, ``beta = alpha = 1``) of at
    least ``min_macs`` multiply-adds into ``recir::cpu_matmul``, in place (for a step compiled for the
    CPU device). Returns counts per op."""
    counts = {"mm": 0, "addmm": 0, "transposed": 0, "kept": 0}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (
            torch.ops.aten.mm.default,
            torch.ops.aten.addmm.default,
        ):
            continue
        is_addmm = node.target is torch.ops.aten.addmm.default
        bias, a, b = node.args[:3] if is_addmm else (None, *node.args[:2])
        operands = [a, b] + ([bias] if bias is not None else [])
        if not all(_fp32(x) for x in [node, *operands]):
            continue
        m, k = a.meta["val"].shape
        n = b.meta["val"].shape[1]
        plain = not is_addmm or (
            bias.meta["val"].shape == (n,)
            and node.kwargs.get("beta", 1) == 1
            and node.kwargs.get("alpha", 1) == 1
            and len(node.args) == 3
        )
        if not plain or m * k * n < min_macs:
            counts["kept"] += 1
            continue
        new = _matmul(gm.graph, node, a, b, bias)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        counts["addmm" if is_addmm else "mm"] += 1
        counts["transposed"] += new.target is torch.ops.aten.t.default
    if counts["mm"] or counts["addmm"]:
        gm.graph.lint()
        gm.recompile()
    return counts


def _matmul(graph: fx.Graph, node: fx.Node, a: fx.Node, b: fx.Node, bias: fx.Node | None) -> fx.Node:
    """``recir::cpu_matmul`` nodes computing ``node`` (``a @ b + bias``), inserted before it."""

    def add(target: object, args: tuple, val: Tensor) -> fx.Node:
        new = graph.call_function(target, args)  # type: ignore[arg-type]
        new.meta.update(node.meta, val=val)  # phase, module path
        if target is torch.ops.recir.cpu_matmul.default:
            new.meta[OVERRIDE_KEY] = OVERRIDE
        return new

    a_val, b_val, out_val = a.meta["val"], b.meta["val"], node.meta["val"]
    with graph.inserting_before(node):
        if bias is not None or not _transposed(a_val, b_val):
            return add(torch.ops.recir.cpu_matmul.default, (a, b, bias), out_val)
        bt = add(torch.ops.aten.t.default, (b,), b_val.t())
        at = add(torch.ops.aten.t.default, (a,), a_val.t())
        out_t = add(
            torch.ops.recir.cpu_matmul.default, (bt, at, None), out_val.new_empty(out_val.shape[::-1])
        )
        return add(torch.ops.aten.t.default, (out_t,), out_t.meta["val"].t())
