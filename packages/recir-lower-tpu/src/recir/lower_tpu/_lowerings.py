"""RecIR's JAX lowerings for ops torchax 0.0.13 lacks or gets wrong (all jittable, static shapes).

Registered at import into the registry of ``_registry.py``; ``_env.py`` installs them into the torchax
environment through its public ``Environment.override_op_definition``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ._registry import register_jax_lowering

# -- recir::counter_uniform (recir-capture's random numbers) --------------------------------------
# recir.transforms.mix32's and recir.capture._rng's constants
_M32, _MUL, _GOLDEN = 0xFFFFFFFF, 0x45D9F3B, 0x9E3779B9


def _mix32(x):
    """recir.transforms.mix32 on uint32: its int64 products masked to 32 bits are uint32's wrapping ones."""
    x = jnp.bitwise_xor(x >> 16, x) * jnp.uint32(_MUL)
    x = jnp.bitwise_xor(x >> 16, x) * jnp.uint32(_MUL)
    return jnp.bitwise_xor(x >> 16, x)


@register_jax_lowering("recir::counter_uniform")
def recir_counter_uniform(key, base: int, n: int):
    """The reference's counter hash in uint32 instead of int64 masked to 32 bits: equal bit for bit (every
    sum and product is taken mod 2**32 either way), without the 64-bit integer maths a TPU emulates.

    The numbers leave through an optimization barrier, so XLA on a TPU computes them once, in a fusion of
    their own. Without it, XLA fuses the hash into every consumer: a dropout's product in the forward and
    the products of its backward each carry the hash as an epilogue, and the TPU compiler's scheduling and
    register allocation of those large product fusions grew with it (DLRMv3 full size, UIH 64, on a v5e:
    XLA's compile of the fp32 step, float32 products at ``highest``, 173-175 s without the barrier and 134 s
    with it; bf16 37.5-37.9 -> 34.3 s; the step's time unchanged). XLA:CPU expands barriers before fusion,
    so CPU programs are unchanged."""
    k1 = jax.lax.convert_element_type(key & _M32, jnp.uint32)
    k2 = _mix32(jnp.bitwise_xor(k1, jnp.uint32(_GOLDEN)))
    ctr = jax.lax.iota(jnp.uint32, n) + jnp.uint32(base & _M32) + k2
    bits = _mix32(jnp.bitwise_xor(ctr, k1))
    return jax.lax.optimization_barrier((bits >> 8).astype(jnp.float32) * jnp.float32(1.0 / (1 << 24)))


# -- recir::embedding_bag ------------------------------------------------------------------------
@register_jax_lowering("recir::embedding_bag")
def recir_embedding_bag(weight, indices, offsets, per_sample_weights, mode: int):
    """Pooled lookup: ids map to bags by a sorted search over offsets[1:], then a segment sum."""
    return pool_bags(jnp.take(weight, indices, axis=0), offsets, per_sample_weights, mode, indices.shape[0])


def pool_bags(rows, offsets, per_sample_weights, mode: int, num_ids: int):
    """Per-bag sum (mode 0) or mean (mode 1) of ``rows`` (one per id), bags given by ``offsets[B+1]``."""
    num_bags = offsets.shape[0] - 1
    seg = jnp.searchsorted(offsets[1:], jnp.arange(num_ids, dtype=offsets.dtype), side="right")
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(rows.dtype)
    pooled = jax.ops.segment_sum(rows, seg, num_segments=num_bags, indices_are_sorted=True)
    if mode == 1:
        lengths = jnp.maximum(offsets[1:] - offsets[:-1], 1).astype(pooled.dtype)
        pooled = pooled / lengths[:, None]
    return pooled


# -- aten::_embedding_bag (torchax's loops over concrete offsets: not jittable, and no backward) ---------
def _offset2bag(indices, offsets, num_bags: int):
    """Each id's bag from torch's offsets (B starts, or B+1 with the last end); ids past the end -> B."""
    positions = jnp.arange(indices.shape[0], dtype=offsets.dtype)
    offset2bag = jnp.searchsorted(offsets[:num_bags], positions, side="right") - 1
    if offsets.shape[0] > num_bags:  # include_last_offset: ids past the last end belong to no bag
        offset2bag = jnp.where(positions < offsets[num_bags], offset2bag, num_bags)
    return offset2bag


def _bag_segments(indices, offset2bag, num_bags: int, padding_idx):
    """Segment ids with padding ids sent to the dropped segment ``num_bags``, and per-bag id counts."""
    seg = offset2bag
    if padding_idx is not None and padding_idx >= 0:
        seg = jnp.where(indices != padding_idx, seg, num_bags)
    counts = jax.ops.segment_sum(jnp.ones_like(seg), seg, num_segments=num_bags)
    return seg, counts


@register_jax_lowering("recir::recompute_barrier")
def recir_recompute_barrier(xs):
    """recir-recompute-activations' fence: without it XLA merges the backward's recomputed values with
    the forward's (CSE) and keeps them alive across the step. ``optimization_barrier`` is that fence on
    TPU (JAX's remat uses it), but XLA:CPU drops it before CSE (measured, jax 0.10.2); so each output
    also ORs in a zero computed from the last input (the backward value the copies wait for): bit-exact,
    and no compiler can prove it equal to its forward twin or schedule it before that value."""
    xs = list(jax.lax.optimization_barrier(tuple(xs)))
    if len(xs) < 2:
        return xs
    last = xs[-1].reshape(-1)[:1]
    zero = jnp.minimum(last.astype(jnp.uint8), jnp.uint8(0))[0]  # 0: an unsigned minimum with 0
    return [*(_or_zero(x, zero) for x in xs[:-1]), xs[-1]]


def _or_zero(x, zero):
    if x.dtype == jnp.bool_:
        return jnp.logical_or(x, zero > 0)
    bits = jnp.dtype(f"uint{x.dtype.itemsize * 8}")
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, bits) | zero.astype(bits), x.dtype)


@register_jax_lowering("aten::_embedding_bag")
@register_jax_lowering("aten::_embedding_bag_forward_only")
def aten_embedding_bag(
    weight,
    indices,
    offsets,
    scale_grad_by_freq=False,
    mode=0,
    sparse=False,
    per_sample_weights=None,
    include_last_offset=False,
    padding_idx=-1,
):
    """(output, offset2bag, bag_size, max_indices); the auxiliary shapes follow ATen's CPU meta."""
    del scale_grad_by_freq, sparse
    num_bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    offset2bag = _offset2bag(indices, offsets, num_bags)
    seg, counts = _bag_segments(indices, offset2bag, num_bags, padding_idx)
    rows = jnp.take(weight, indices, axis=0)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights[:, None].astype(rows.dtype)
    max_indices = jnp.zeros((num_bags,), dtype=offsets.dtype)
    if mode == 2:
        out = jax.ops.segment_max(rows, seg, num_segments=num_bags)
        out = jnp.where(counts[:, None] > 0, out, 0).astype(weight.dtype)
        hit = rows == out[jnp.clip(seg, 0, num_bags - 1)]
        cand = jnp.where(hit, indices[:, None], jnp.iinfo(indices.dtype).max)
        max_indices = jax.ops.segment_min(cand, seg, num_segments=num_bags)
        max_indices = jnp.where(counts[:, None] > 0, max_indices, -1).astype(offsets.dtype)
    else:
        out = jax.ops.segment_sum(rows, seg, num_segments=num_bags)
        if mode == 1:
            out = out / jnp.maximum(counts, 1)[:, None].astype(out.dtype)
    # ATen's fast sum path (float weights, no padding id) returns an empty offset2bag.
    no_padding = padding_idx is None or padding_idx < 0
    fast_sum = mode == 0 and weight.dtype in (jnp.float32, jnp.float16) and no_padding
    if fast_sum:
        offset2bag = jnp.zeros((0,), offsets.dtype)
    return out, offset2bag.astype(offsets.dtype), counts.astype(offsets.dtype), max_indices


@register_jax_lowering("aten::_embedding_bag_backward")
def aten_embedding_bag_backward(
    grad,
    indices,
    offsets,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    sparse,
    per_sample_weights,
    padding_idx=-1,
):
    """The dense weight gradient; ids' bags are recomputed from offsets (the forward may omit them)."""
    del offset2bag, bag_size
    if sparse:
        raise NotImplementedError("sparse embedding_bag gradients: use sparse=False (dense) on this path")
    offset2bag = _offset2bag(indices, offsets, grad.shape[0])
    return aten_embedding_bag_dense_backward(
        grad,
        indices,
        offset2bag,
        None,
        maximum_indices,
        num_weights,
        scale_grad_by_freq,
        mode,
        per_sample_weights,
        padding_idx,
    )


@register_jax_lowering("aten::_embedding_bag_dense_backward")
def aten_embedding_bag_dense_backward(
    grad,
    indices,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights,
    scale_grad_by_freq,
    mode,
    per_sample_weights,
    padding_idx=-1,
):
    del bag_size  # recomputed without padding ids, as the forward divided by
    num_bags, dim = grad.shape
    if mode == 2:
        flat_rows = maximum_indices.reshape(-1)
        cols = jnp.tile(jnp.arange(dim), num_bags)
        keep = (flat_rows >= 0).astype(grad.dtype)
        return (
            jnp.zeros((num_weights, dim), grad.dtype)
            .at[jnp.maximum(flat_rows, 0), cols]
            .add(grad.reshape(-1) * keep)
        )
    if offset2bag.shape[0] != indices.shape[0]:
        raise NotImplementedError(
            "_embedding_bag_dense_backward needs offset2bag (ATen's fast path omits it)"
        )
    seg, counts = _bag_segments(indices, offset2bag, num_bags, padding_idx)
    keep = (seg < num_bags).astype(grad.dtype)
    safe = jnp.clip(seg, 0, num_bags - 1)
    per_id = jnp.take(grad, safe, axis=0) * keep[:, None]
    if mode == 1:
        per_id = per_id / jnp.maximum(jnp.take(counts, safe), 1)[:, None].astype(grad.dtype)
    if per_sample_weights is not None:
        per_id = per_id * per_sample_weights[:, None].astype(grad.dtype)
    if scale_grad_by_freq:
        freq = jnp.zeros((num_weights,), grad.dtype).at[indices].add(1.0)
        per_id = per_id / jnp.take(freq, indices)[:, None]
    return jnp.zeros((num_weights, dim), grad.dtype).at[indices].add(per_id)


@register_jax_lowering("aten::_embedding_bag_per_sample_weights_backward")
def aten_embedding_bag_psw_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    del mode
    num_bags = grad.shape[0]
    if offset2bag.shape[0] != indices.shape[0]:
        offset2bag = _offset2bag(indices, offsets, num_bags)
    seg, _ = _bag_segments(indices, offset2bag, num_bags, padding_idx)
    per_id = jnp.take(grad, jnp.clip(seg, 0, num_bags - 1), axis=0)
    out = jnp.sum(per_id * jnp.take(weight, indices, axis=0), axis=1)
    return jnp.where(seg < num_bags, out, 0).astype(grad.dtype)


# -- matrix products: accumulate in fp32 (torchax's `x @ y` accumulates bf16 in bf16) ---------------
def _matmul(x, y):
    """``x @ y`` with an fp32 accumulator, returned in the operands' dtype (torch's semantics). On
    x86 CPUs this is also what selects XLA:CPU's YNNPACK bf16 kernels (AMX): measured 1.7 ms against
    10 ms for a bf16 1216x512x2048 product accumulated in bf16 (see `_row_major_transpose` for the
    operand layout those kernels need)."""
    if x.dtype in (jnp.bfloat16, jnp.float16) and x.dtype == y.dtype:
        return jnp.matmul(x, y, preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.matmul(x, y)


@register_jax_lowering("aten::mm")
@register_jax_lowering("aten::bmm")
def aten_mm(x, y):
    return _matmul(x, y)


@register_jax_lowering("aten::addmm")
@register_jax_lowering("aten::baddbmm")
def aten_addmm(bias, x, y, *, beta=1.0, alpha=1.0):
    prod = _matmul(x, y)
    if alpha != 1:
        prod = prod * jnp.asarray(alpha, prod.dtype)
    if beta == 0:  # torch ignores self (even NaN) when beta is 0
        return prod
    return prod + (bias if beta == 1 else bias * jnp.asarray(beta, bias.dtype))


# -- transposes of bf16/fp16 arrays on XLA:CPU: row-major results, so the products reading them stay bf16 -
def _row_major_transpose(x, perm: Sequence[int]):
    """``jnp.transpose(x, perm)``; for a bf16/fp16 array on XLA:CPU, one whose result stays row-major.

    XLA gives a transpose a permuted layout (a free bitcast) and lets the product reading it take that
    layout. XLA:CPU's fast bf16 products (YNNPACK, AMX tiles on this CPU) take row-major operands only,
    so such a product is upcast to fp32 first and runs at fp32 speed: every backward product (`dY @ W`,
    `X^T @ dY`) and every `x @ W^T` of a linear layer. Transposing with a leading unit axis that a
    reshape then drops makes the row-major reshape the product's operand: XLA copies once and the
    product stays bf16 (a 1216x512x2048 product with a transposed operand: 9.6 -> 2.0 ms; DLRMv3's
    full-size bf16 step at UIH 64: 315 -> 183 ms). Values are unchanged. fp32 is left alone: its
    transposed products are as fast as the copy would cost (the same step ran 318 ms without the copy,
    361 ms with it), and other backends choose their own layouts.
    """
    perm = tuple(int(p) % x.ndim for p in perm)
    if (
        x.dtype not in (jnp.bfloat16, jnp.float16)
        or perm == tuple(range(x.ndim))
        or jax.default_backend() != "cpu"
    ):
        return jnp.transpose(x, perm)
    shape = tuple(x.shape[p] for p in perm)
    return jnp.transpose(x[None], (0, *(p + 1 for p in perm))).reshape(shape)


@register_jax_lowering("aten::permute")
def aten_permute(x, dims):
    return _row_major_transpose(x, dims)


@register_jax_lowering("aten::t")
def aten_t(x):
    return x if x.ndim < 2 else _row_major_transpose(x, (1, 0))


@register_jax_lowering("aten::transpose.int")
def aten_transpose(x, dim0, dim1):
    perm = list(range(x.ndim))
    perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
    return _row_major_transpose(x, perm)


# -- searchsorted (torchax ignores right=/side=/sorter=/out_int32=) ---------------------------------
@register_jax_lowering("aten::searchsorted.Tensor")
def aten_searchsorted(sorted_sequence, values, *, out_int32=False, right=False, side=None, sorter=None):
    side = side or ("right" if right else "left")
    if sorter is not None:
        sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter, axis=-1)
    if sorted_sequence.ndim <= 1:
        res = jnp.searchsorted(sorted_sequence, values, side=side)
    else:
        lead = sorted_sequence.shape[:-1]
        seq = sorted_sequence.reshape(-1, sorted_sequence.shape[-1])
        vals = values.reshape(seq.shape[0], -1)
        res = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=side))(seq, vals).reshape(*lead, -1)
    return res.astype(jnp.int32 if out_int32 else _int64())


def _int64() -> Any:
    """int64 under x64, else int32 (JAX's canonical integer)."""
    return jax.dtypes.canonicalize_dtype(jnp.int64)


# -- layer norm backward (torchax calls a jax.lax function that does not exist) ----------------------
@register_jax_lowering("aten::native_layer_norm_backward")
def aten_native_layer_norm_backward(
    grad_out, input, normalized_shape: Sequence[int], mean, rstd, weight, bias, output_mask
):
    axes = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    lead = tuple(range(input.ndim - len(normalized_shape)))
    n = math.prod(normalized_shape)
    x_hat = (input - mean) * rstd
    g = grad_out * weight if weight is not None else grad_out
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        sum_g = jnp.sum(g, axis=axes, keepdims=True)
        sum_gx = jnp.sum(g * x_hat, axis=axes, keepdims=True)
        grad_input = ((rstd / n) * (n * g - sum_g - x_hat * sum_gx)).astype(input.dtype)
    if output_mask[1] and weight is not None:
        grad_weight = jnp.sum(grad_out * x_hat, axis=lead).astype(weight.dtype)
    if output_mask[2] and bias is not None:
        grad_bias = jnp.sum(grad_out, axis=lead).astype(bias.dtype)
    return grad_input, grad_weight, grad_bias


# -- batch norm: the functional variant, with PyTorch's unbiased running variance -------------------
@register_jax_lowering("aten::_native_batch_norm_legit_functional")
def aten_batch_norm_functional(input, weight, bias, running_mean, running_var, training, momentum, eps):
    axes = (0, *range(2, input.ndim))
    shape = (1, -1) + (1,) * (input.ndim - 2)
    if training:
        mean = jnp.mean(input, axis=axes)
        var = jnp.var(input, axis=axes)
        count = input.size // input.shape[1]
        new_mean = (1 - momentum) * running_mean + momentum * mean
        unbiased = var * (count / max(count - 1, 1))
        new_var = (1 - momentum) * running_var + momentum * unbiased
    else:
        mean, var, new_mean, new_var = running_mean, running_var, running_mean, running_var
    rstd = jax.lax.rsqrt(var + eps)
    out = (input - mean.reshape(shape)) * rstd.reshape(shape)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return (
        out.astype(input.dtype),
        mean.astype(input.dtype),
        rstd.astype(input.dtype),
        new_mean.astype(running_mean.dtype),
        new_var.astype(running_var.dtype),
    )


# -- scaled dot-product attention (fused CPU/CUDA variants: forward and backward) -------------------
def _sdpa(q, k, v, attn_mask, is_causal: bool, scale: float | None):
    """(output, logsumexp[B, H, L]) of softmax(q k^T * scale + mask) v, in float32 internally."""
    if k.shape[-3] != q.shape[-3]:  # grouped-query attention
        rep = q.shape[-3] // k.shape[-3]
        k, v = jnp.repeat(k, rep, axis=-3), jnp.repeat(v, rep, axis=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("...ld,...sd->...ls", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if is_causal:
        causal = jnp.tril(jnp.ones((q.shape[-2], k.shape[-2]), dtype=bool))
        s = jnp.where(causal, s, -jnp.inf)
    if attn_mask is not None:
        s = jnp.where(attn_mask, s, -jnp.inf) if attn_mask.dtype == jnp.bool_ else s + attn_mask
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("...ls,...sd->...ld", p, v.astype(jnp.float32)).astype(q.dtype)
    return out, lse


def _no_dropout(op: str, dropout_p: float) -> None:
    if dropout_p:
        raise NotImplementedError(
            f"{op} with dropout_p={dropout_p}: the TPU path has no in-kernel dropout. "
            "Capture attention dropout as explicit ops drawing from an rng state slot."
        )


def _sdpa_grads(grad_out, q, k, v, attn_mask, is_causal, scale):
    _, vjp = jax.vjp(lambda q_, k_, v_: _sdpa(q_, k_, v_, attn_mask, is_causal, scale)[0], q, k, v)
    return vjp(grad_out.astype(q.dtype))


@register_jax_lowering("aten::_scaled_dot_product_flash_attention_for_cpu")
def aten_sdpa_flash_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    _no_dropout("_scaled_dot_product_flash_attention_for_cpu", dropout_p)
    return _sdpa(query, key, value, attn_mask, is_causal, scale)


@register_jax_lowering("aten::_scaled_dot_product_flash_attention_for_cpu_backward")
def aten_sdpa_flash_cpu_backward(
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None
):
    del out, logsumexp  # recomputed: the backward re-derives the probabilities (flash style)
    _no_dropout("_scaled_dot_product_flash_attention_for_cpu_backward", dropout_p)
    return _sdpa_grads(grad_out, query, key, value, attn_mask, is_causal, scale)


@register_jax_lowering("aten::_scaled_dot_product_efficient_attention")
def aten_sdpa_efficient(
    query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None
):
    _no_dropout("_scaled_dot_product_efficient_attention", dropout_p)
    out, lse = _sdpa(query, key, value, attn_bias, is_causal, scale)
    if compute_log_sumexp:  # ATen pads the query length to a multiple of 32
        padded = -(-query.shape[-2] // 32) * 32
        lse = jnp.pad(lse, [(0, 0)] * (lse.ndim - 1) + [(0, padded - lse.shape[-1])])
    else:
        lse = jnp.zeros((*lse.shape[:-1], 0), jnp.float32)
    seed = jnp.zeros((), _int64())
    return out, lse, seed, seed


@register_jax_lowering("aten::_scaled_dot_product_efficient_attention_backward")
def aten_sdpa_efficient_backward(
    grad_out,
    query,
    key,
    value,
    attn_bias,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    dropout_p,
    grad_input_mask,
    is_causal=False,
    *,
    scale=None,
):
    del out, logsumexp, philox_seed, philox_offset
    _no_dropout("_scaled_dot_product_efficient_attention_backward", dropout_p)
    gq, gk, gv = _sdpa_grads(grad_out, query, key, value, attn_bias, is_causal, scale)
    gbias: Any = None
    if attn_bias is not None and len(grad_input_mask) > 3 and grad_input_mask[3]:
        _, vjp = jax.vjp(lambda b: _sdpa(query, key, value, b, is_causal, scale)[0], attn_bias)
        (gbias,) = vjp(grad_out.astype(query.dtype))
    return gq, gk, gv, gbias


# -- aten::view.dtype ----------------------------------------------------------------------------
@register_jax_lowering("aten::view.dtype")
def aten_view_dtype(x, dtype):
    """``Tensor.view(dtype)`` (torchax 0.0.13 has none): the bytes reinterpreted, as ATen does, along
    the last dimension, which a wider dtype divides by the size ratio and a narrower one multiplies.
    recir-embedding's FBGEMM-layout tables read their fp16 scale and bias out of uint8 rows this way."""
    from ._convert import jax_dtype

    target = jnp.dtype(dtype) if isinstance(dtype, (str, jnp.dtype)) else jnp.dtype(jax_dtype(dtype))
    src, dst = x.dtype.itemsize, target.itemsize
    if src == dst:
        return jax.lax.bitcast_convert_type(x, target)
    if dst > src:  # (..., d) -> (..., d / k, k) -> (..., d / k)
        k = dst // src
        return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // k, k), target)
    out = jax.lax.bitcast_convert_type(x, target)  # (..., d, k)
    return out.reshape(*x.shape[:-1], x.shape[-1] * (src // dst))
