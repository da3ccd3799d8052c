"""JAX lowerings of ``recir::hstu_attention`` and its backward: a blocked formulation (the default), and
``recir::hstu_attention_pallas`` / ``recir::hstu_attention_backward_pallas``, the forward and the backward as
the Pallas kernels of ``_hstu_pallas.py`` and ``_hstu_pallas_backward.py`` (jagged: they never multiply
padded history keys), which ``TPUOptions(attention_kernel="pallas")`` retargets to.

Blocked: the query rows in the op's row blocks, each against only the prefix keys it can see (no
``[B, N, N]`` mask, no products over the candidates' keys); the backward recomputes each block's scores
behind ``recir::recompute_barrier``'s fence, so XLA neither keeps nor CSEs them with the forward's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
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

from ._lowerings import recir_recompute_barrier
from ._registry import register_jax_lowering

ATTENTION_KERNELS = ("blocked", "pallas")


def _blocks(bounds: Sequence[int], prefix: int, dtype: Any) -> list[tuple[int, int, int, Any]]:
    """(r0, r1, c, earlier) per query row block: the prefix keys it sees and the causal 0/1 part."""
    out = []
    for r0, r1 in zip(bounds[:-1], bounds[1:]):
        c = min(r1, prefix)
        out.append((r0, r1, c, (jnp.arange(c)[None, :] < jnp.arange(r0, r1)[:, None]).astype(dtype)))
    return out


def _dot(a, b):  # batched [.., m, k] x [.., k, n], f32 accumulation for bf16 operands
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


@register_jax_lowering("recir::hstu_attention")
def hstu_attention_blocked(q, k, v, valid, scale, prefix: int, alpha: float, bounds: Sequence[int]):
    """``recir.transforms.hstu_attention_reference`` in JAX, block by block."""
    scale = jnp.asarray(scale).astype(q.dtype)  # as ATen's 0-d tensor: never promotes bf16 q to fp32
    keep = valid[:, None, :, None].astype(q.dtype)
    keys = k[:, :, :prefix] * keep[:, :, :prefix]
    own = jax.nn.silu(alpha * jnp.sum(q * k, axis=-1, keepdims=True)) / scale
    outs = []
    for r0, r1, c, earlier in _blocks(bounds, prefix, q.dtype):
        scores = jax.nn.silu(alpha * _dot(q[:, :, r0:r1], jnp.swapaxes(keys[:, :, :c], -1, -2))) / scale
        outs.append(_dot(scores * earlier, v[:, :, :c]))
    attn = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
    return (attn + own * v) * keep


def _silu_grad(g, s):  # d silu(s) / ds * g
    sig = jax.nn.sigmoid(s)
    return g * sig * (1 + s * (1 - sig))


@register_jax_lowering("recir::hstu_attention_backward")
def hstu_attention_backward_blocked(
    grad, q, k, v, valid, scale, prefix: int, alpha: float, bounds: Sequence[int]
):
    """``recir.transforms.hstu_attention_backward_reference`` in JAX: (dq, dk, dv), scores recomputed."""
    p = prefix
    B, H, N, A = q.shape
    scale = jnp.asarray(scale).astype(q.dtype)
    keep = valid[:, None, :, None].astype(q.dtype)
    g = grad * keep
    q, keys, _ = recir_recompute_barrier([q, k[:, :, :p] * keep[:, :, :p], grad])
    dq_blocks = []
    dkeys = jnp.zeros((B, H, p, A), q.dtype)
    dv_prefix = jnp.zeros((B, H, p, A), q.dtype)
    for r0, r1, c, earlier in _blocks(bounds, p, q.dtype):
        q_b, g_b, keys_c = q[:, :, r0:r1], g[:, :, r0:r1], keys[:, :, :c]
        s = alpha * _dot(q_b, jnp.swapaxes(keys_c, -1, -2))
        weights = jax.nn.silu(s) / scale * earlier
        ds = _silu_grad(_dot(g_b, jnp.swapaxes(v[:, :, :c], -1, -2)) * earlier, s) / scale
        dq_blocks.append(alpha * _dot(ds, keys_c))
        dkeys = dkeys.at[:, :, :c].add(alpha * _dot(jnp.swapaxes(ds, -1, -2), q_b))
        dv_prefix = dv_prefix.at[:, :, :c].add(_dot(jnp.swapaxes(weights, -1, -2), g_b))
    t = alpha * jnp.sum(q * k, axis=-1, keepdims=True)
    dt = _silu_grad(jnp.sum(g * v, axis=-1, keepdims=True), t) / scale
    dq = (dq_blocks[0] if len(dq_blocks) == 1 else jnp.concatenate(dq_blocks, axis=2)) + alpha * dt * k
    tail = ((0, 0), (0, 0), (0, N - p), (0, 0))
    dk = jnp.pad(dkeys * keep[:, :, :p], tail) + alpha * dt * q
    dv = jnp.pad(dv_prefix, tail) + jax.nn.silu(t) / scale * g
    return dq, dk, dv


# -- the Pallas forward ----------------------------------------------------------------------------
@torch.library.custom_op("recir::hstu_attention_pallas", mutates_args=())
def hstu_attention_pallas(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    valid: Tensor,
    scale: Tensor,
    prefix: int,
    alpha: float,
    bounds: list[int],
) -> Tensor:
    """``recir::hstu_attention``'s forward, run by the Pallas kernel on the TPU path (its ATen reference
    anywhere else). Same arguments; ``bounds`` is not used by the kernel, which blocks on its own."""
    return hstu_attention_reference(q, k, v, valid, scale, prefix, alpha, bounds).contiguous()


@hstu_attention_pallas.register_fake
def _hstu_attention_pallas_fake(q, k, v, valid, scale, prefix, alpha, bounds):
    return q.new_empty(q.shape)  # contiguous, as recir::hstu_attention's


register_override_op("recir::hstu_attention_pallas", HSTU_ATTENTION_OVERRIDE)


@register_jax_lowering("recir::hstu_attention_pallas")
def _hstu_attention_pallas_lowering(q, k, v, valid, scale, prefix: int, alpha: float, bounds: Sequence[int]):
    from ._hstu_pallas import hstu_attention_pallas as kernel  # here: Pallas's import costs a second

    if jnp.ndim(scale) != 0:  # a per-sample normaliser (serving): the kernel takes one scalar
        return hstu_attention_blocked(q, k, v, valid, scale, prefix, alpha, bounds)
    return kernel(q, k, v, valid, scale, prefix, alpha)


# -- the Pallas backward ---------------------------------------------------------------------------
@torch.library.custom_op("recir::hstu_attention_backward_pallas", mutates_args=())
def hstu_attention_backward_pallas(
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
    """``recir::hstu_attention_backward``, run by the Pallas kernels of ``_hstu_pallas_backward.py`` on the TPU
    path (its ATen reference anywhere else). Same arguments and outputs."""
    dq, dk, dv = hstu_attention_backward_reference(grad, q, k, v, valid, scale, prefix, alpha, bounds)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@hstu_attention_backward_pallas.register_fake
def _hstu_attention_backward_pallas_fake(grad, q, k, v, valid, scale, prefix, alpha, bounds):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


register_override_op("recir::hstu_attention_backward_pallas", HSTU_ATTENTION_OVERRIDE)


@register_jax_lowering("recir::hstu_attention_backward_pallas")
def _hstu_attention_backward_pallas_lowering(
    grad, q, k, v, valid, scale, prefix: int, alpha: float, bounds: Sequence[int]
):
    from ._hstu_pallas_backward import hstu_attention_backward_pallas as kernels

    if jnp.ndim(scale) != 0:  # a per-sample normaliser: the kernels take one scalar
        return hstu_attention_backward_blocked(grad, q, k, v, valid, scale, prefix, alpha, bounds)
    return kernels(grad, q, k, v, valid, scale, prefix, alpha)


_PALLAS = {
    torch.ops.recir.hstu_attention.default: torch.ops.recir.hstu_attention_pallas.default,
    torch.ops.recir.hstu_attention_backward.default: torch.ops.recir.hstu_attention_backward_pallas.default,
}


@register_transform
class PallasAttention(Transform):
    """Each ``recir::hstu_attention`` and its backward become ``recir::hstu_attention_pallas`` and
    ``recir::hstu_attention_backward_pallas`` (the Pallas kernels; ``TPUOptions(attention_kernel="pallas")``)::

        %a = recir.hstu_attention(%q, %k, %v, %valid, %scale, 66, 0.088, [0, 76])           # before
        %a = recir.hstu_attention_pallas(%q, %k, %v, %valid, %scale, 66, 0.088, [0, 76])    # after
    """

    name = "recir-tpu-pallas-attention"
    summary = "run recir::hstu_attention and its backward as the Pallas kernels"

    def run(self, step: StepGraph) -> TransformResult:
        n = 0
        for node in step.graph.nodes:
            target = _PALLAS.get(node.target) if node.op == "call_function" else None  # type: ignore[call-overload]
            if target is not None:
                node.target = target
                node.meta[OVERRIDE_KEY] = HSTU_ATTENTION_OVERRIDE
                n += 1
        if n:
            step.graph_module.recompile()
        return TransformResult(step, bool(n), {"kernels": n})
