"""``recir::hstu_attention`` and its backward as Triton kernels that never hold a score tensor: the GPU
path's fused attention for CUDA devices (``GPUOptions(hstu_attention="triton")``, :class:`TritonAttention`).

Each program takes one block of query rows (forward, ``dq``) or of history keys (``dk``, ``dv``) of one
(sample, head), walks the other side block by block, recomputes ``silu(alpha q.k) / scale`` with the
target-aware causal mask in registers (key ``j`` is seen by query ``i`` iff ``j < i`` and ``j`` is in
the history, ``j < prefix``) and accumulates the products in float32. Memory is ``O(B H N A)`` at any
sequence length, where the ATen reference holds ``[B, H, rows, keys]`` per row block. Jagged: key blocks
past a query block's last row (about half the dense work on the history) or past the sample's valid
history (``valid`` is a prefix there, the op's contract) are skipped, and so are query blocks made only of
padded history rows.

The kernels compute the history part (``cross``) only, on keys already zeroed at padded slots (as the
reference does: SiLU(0) = 0); each token's own score, the padded rows' zeros and the gradient's
``valid`` factors are elementwise and stay in ATen around them (:func:`hstu_attention_triton`,
:func:`hstu_attention_backward_triton`), so the maths is ``recir.transforms.hstu_attention_reference``'s
term for term (float32 accumulation; float32 products in IEEE precision, no TF32).

Triton is imported when first used (it comes with torch's CUDA wheels on Linux; nothing here runs
without it). With ``TRITON_INTERPRET=1`` set before the first use, the same kernels run on CPU tensors
in Triton's interpreter: that is how the tests check them on a machine without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from recir.transforms import (
    HSTU_ATTENTION_OVERRIDE,
    OVERRIDE_KEY,
    StepGraph,
    Transform,
    TransformResult,
    hstu_attention_backward_reference,
    hstu_attention_reference,
    register_override_op,
    register_transform,
)
from torch import Tensor


def kernel_constants(dtype: torch.dtype, head_dim: int) -> dict[str, Any]:
    """The kernels' compile-time block shape for ``dtype`` and ``head_dim``: 64 query rows per program and
    64 keys per loop step; 32 and 32 for float32 with a head dim above 64, where the ``dk``/``dv`` kernel's
    tiles at 64 take 144 KiB of shared memory (within an A100's or H100's block, past the 99 KiB of Ampere
    and Ada consumer GPUs; 68 KiB at 32). Float32 products in IEEE precision (no TF32)."""
    block_a = max(16, 1 << (max(head_dim, 1) - 1).bit_length())
    wide = dtype == torch.float32 and block_a > 64
    return dict(
        BLOCK_M=32 if wide else 64, BLOCK_N=32 if wide else 64, BLOCK_A=block_a, IEEE=dtype == torch.float32
    )


def _kernels() -> tuple[Any, Any, Any]:
    """(forward, dq, dk/dv) Triton kernels, imported on first use."""
    try:
        from . import _hstu_triton_kernels as kernels
    except ImportError as e:  # pragma: no cover - torch's CUDA wheels ship Triton
        raise RuntimeError(
            "recir.lower_gpu: hstu_attention='triton' needs Triton (it comes with torch's CUDA wheels on "
            "Linux). Fix: install torch's CUDA build, or use GPUOptions(hstu_attention='inductor')."
        ) from e
    return kernels.forward, kernels.backward_q, kernels.backward_kv


def _launch_args(
    q: Tensor, k: Tensor, v: Tensor, scale: Tensor, prefix: int
) -> tuple[Tensor, int, dict[str, Any]]:
    """(scale as a tensor on q's device, its per-sample stride, the kernels' block constants); ValueError
    naming the argument when shapes or ``prefix`` do not fit."""
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"recir::hstu_attention (triton): q, k, v must share one [B, H, N, A] shape, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, H, N, A = q.shape
    if not 0 < prefix <= N:
        raise ValueError(f"recir::hstu_attention (triton): prefix must be in (0, N = {N}], got {prefix}")
    if scale.dim() not in (0, 1) or (scale.dim() == 1 and scale.shape[0] not in (1, B)):
        raise ValueError(
            f"recir::hstu_attention (triton): scale must be 0-d or one value per sample [B = {B}], got "
            f"{tuple(scale.shape)}"
        )
    s = scale.reshape(-1).to(q.device)
    return s, (1 if s.numel() == B and B > 1 else 0), kernel_constants(q.dtype, A)


def _keys(k: Tensor, valid: Tensor, prefix: int) -> tuple[Tensor, Tensor, Tensor]:
    """(keep [B, 1, N, 1] in k's dtype, k with its padded slots zeroed, contiguous; each sample's valid
    history slots, int32 [B]: the kernels skip the blocks past them, which ``valid`` being a prefix of
    the history, the op's contract, makes exact)."""
    keep = valid[:, None, :, None].to(k.dtype)
    history = valid[:, :prefix].sum(dim=1, dtype=torch.int32).contiguous()
    return keep, (k * keep).contiguous(), history


def hstu_attention_triton(
    q: Tensor, k: Tensor, v: Tensor, valid: Tensor, scale: Tensor, prefix: int, alpha: float
) -> Tensor:
    """``recir::hstu_attention``'s value through the Triton forward kernel (q, k, v [B, H, N, A])."""
    import triton

    forward, _, _ = _kernels()
    s, s_stride, consts = _launch_args(q, k, v, scale, prefix)
    B, H, N, A = q.shape
    keep, keys, history = _keys(k, valid, prefix)
    q_, v_ = q.contiguous(), v.contiguous()
    cross = torch.empty_like(q_)
    grid = (B * H, triton.cdiv(N, consts["BLOCK_M"]))  # B * H first: a grid's other axes stop at 65535
    forward[grid](q_, keys, v_, cross, s, s_stride, history, H, N, prefix, A, float(alpha), **consts)
    own = F.silu(alpha * (q * k).sum(dim=-1, keepdim=True)) / scale.reshape(-1, 1, 1, 1).to(q.dtype)
    return ((cross + own * v) * keep).contiguous()


def hstu_attention_backward_triton(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, valid: Tensor, scale: Tensor, prefix: int, alpha: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``recir::hstu_attention_backward``'s (dq, dk, dv) through the Triton ``dq`` and ``dk``/``dv``
    kernels."""
    import triton

    _, backward_q, backward_kv = _kernels()
    s, s_stride, consts = _launch_args(q, k, v, scale, prefix)
    B, H, N, A = q.shape
    keep, keys, history = _keys(k, valid, prefix)
    g = (grad * keep).contiguous()
    q_, v_ = q.contiguous(), v.contiguous()
    dq = torch.empty_like(q_)
    dk, dv = torch.zeros_like(q_), torch.zeros_like(q_)  # keys past the prefix: no history part
    backward_q[(B * H, triton.cdiv(N, consts["BLOCK_M"]))](
        q_, keys, v_, g, dq, s, s_stride, history, H, N, prefix, A, float(alpha), **consts
    )
    backward_kv[(B * H, triton.cdiv(prefix, consts["BLOCK_N"]))](
        q_, keys, v_, g, dk, dv, s, s_stride, history, H, N, prefix, A, float(alpha), **consts
    )
    sc = scale.reshape(-1, 1, 1, 1).to(q.dtype)
    t = alpha * (q * k).sum(dim=-1, keepdim=True)  # each token's own score
    dt = torch.ops.aten.silu_backward.default((g * v).sum(dim=-1, keepdim=True), t) / sc
    return (
        (dq + alpha * dt * k).contiguous(),
        (dk * keep + alpha * dt * q).contiguous(),
        (dv + F.silu(t) / sc * g).contiguous(),
    )


@torch.library.custom_op("recir::hstu_attention_triton", mutates_args=(), device_types="cuda")
def _hstu_attention_triton_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    valid: Tensor,
    scale: Tensor,
    prefix: int,
    alpha: float,
    bounds: list[int],
) -> Tensor:
    """``recir::hstu_attention`` (same arguments, same value) through the Triton kernels; CUDA only."""
    return hstu_attention_triton(q, k, v, valid, scale, prefix, alpha)


@_hstu_attention_triton_op.register_fake
def _(q, k, v, valid, scale, prefix, alpha, bounds):
    return q.new_empty(q.shape)


@torch.library.custom_op("recir::hstu_attention_backward_triton", mutates_args=(), device_types="cuda")
def _hstu_attention_backward_triton_op(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    valid: Tensor,
    scale: Tensor,
    prefix: int,
    alpha: float,
    bounds: list[int],
) -> tuple[Tensor, Tensor, Tensor]:
    """``recir::hstu_attention_backward`` through the Triton kernels; CUDA only."""
    return hstu_attention_backward_triton(grad, q, k, v, valid, scale, prefix, alpha)


@_hstu_attention_backward_triton_op.register_fake
def _(grad, q, k, v, valid, scale, prefix, alpha, bounds):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# The pure-ATen references, by recir-transforms' convention (``<op>_reference`` beside the op): the same
# maths as the ops they stand for, for the reference interpreter and any lowering that inlines them.
hstu_attention_triton_reference = hstu_attention_reference
hstu_attention_backward_triton_reference = hstu_attention_backward_reference
register_override_op("recir::hstu_attention_triton", HSTU_ATTENTION_OVERRIDE)
register_override_op("recir::hstu_attention_backward_triton", HSTU_ATTENTION_OVERRIDE)

_RETARGET = {
    torch.ops.recir.hstu_attention.default: torch.ops.recir.hstu_attention_triton.default,
    torch.ops.recir.hstu_attention_backward.default: torch.ops.recir.hstu_attention_backward_triton.default,
}


@register_transform
class TritonAttention(Transform):
    """``recir::hstu_attention`` and its backward retargeted to their Triton ops (same arguments, same
    values): Inductor calls them as opaque kernels instead of generating the attention from its ATen
    reference.

    Before::

        %attn = recir.hstu_attention(%q, %k, %v, %valid, %scale, 1026, 0.088, [0, 518, 1036])

    After::

        %attn = recir.hstu_attention_triton(%q, %k, %v, %valid, %scale, 1026, 0.088, [0, 518, 1036])
    """

    name = "recir-gpu-triton-attention"
    summary = "run recir::hstu_attention and its backward as fused Triton kernels (CUDA)"

    def run(self, step: StepGraph) -> TransformResult:
        retargeted = 0
        for node in step.graph.nodes:
            target = _RETARGET.get(node.target) if node.op == "call_function" else None  # type: ignore[call-overload]
            if target is not None:
                node.target = target
                node.meta[OVERRIDE_KEY] = HSTU_ATTENTION_OVERRIDE
                retargeted += 1
        if retargeted:
            step.graph_module.recompile()
        return TransformResult(step, bool(retargeted), {"retargeted": retargeted})
