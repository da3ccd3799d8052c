"""Row-wise (sparse) updates on a static-size set of touched rows (the maths: recir.transforms.apply_update).

``dedupe`` turns ``(ids [N], per-id grads [N, D])`` into ``N`` slots of unique rows with summed grads
(sort + boundary detection, no data-dependent shapes); ``sparse_update`` applies an optimizer to those
rows and adds the row deltas back with ``index_put(accumulate=True)`` (unused slots add zeros, so duplicates are harmless).
A table stored in fp16/bf16 (``recir-embed-table-dtype``) is updated in float32 on its gathered rows, and
each new row is rounded back with :func:`round_stochastic` and written as :func:`low_precision_delta`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from recir.transforms import apply_update, mix32, param_optim
from torch import Tensor

SPARSE_KINDS = (
    "sgd",
    "adagrad",
    "rowwise_adagrad",
    "adam",
    "adamw",
)  # every recir.transforms.OPTIMIZER_KINDS


#: Table storage dtypes below float32 -> the float32 mantissa bits a value in their normal range drops.
LOW_PRECISION_BITS = {torch.float16: 13, torch.bfloat16: 16}
_M32 = 0xFFFFFFFF
_FP16_MIN_NORMAL_EXP = 113  # float32's biased exponent of 2**-14, fp16's smallest normal binade
_FP16_MIN_SUBNORMAL = 0x33800000  # float32 bits of 2**-24, fp16's smallest subnormal


def round_stochastic(x: Tensor, dtype: torch.dtype, salt: Tensor) -> Tensor:
    """``x`` (float32) rounded to ``dtype`` (float16 or bfloat16) stochastically, as FBGEMM rounds its
    fp16 tables: to the neighbour above ``|x|`` with probability equal to ``|x|``'s distance from the one
    below, in units of their spacing, so the rounding is unbiased and updates smaller than half a unit
    still move a row on average. A value ``dtype`` holds exactly stays as it is.

    The random bits are a hash of ``x``'s bits and ``salt`` (int64, broadcast against ``x``: each
    element's index in the table), not of an RNG state: the same on every backend, and the same for the
    dense and the row-wise form of an update. In fp16's subnormal range the spacing is 2**-24; magnitudes
    below it, infinities and NaNs round to nearest.
    """
    if dtype not in LOW_PRECISION_BITS:
        raise ValueError(f"round_stochastic: dtype must be float16 or bfloat16, got {dtype}")
    bits = x.view(torch.int32).to(torch.int64) & 0x7FFFFFFF  # |x|'s bits
    if dtype == torch.float16:  # below fp16's normal range every binade drops one bit more
        exponent = bits >> 23
        drop = LOW_PRECISION_BITS[dtype] + (_FP16_MIN_NORMAL_EXP - exponent).clamp(0, 11)
        mask = (torch.ones_like(bits) << drop) - 1
    else:
        mask = torch.full_like(bits, (1 << LOW_PRECISION_BITS[dtype]) - 1)
    noise = mix32(torch.bitwise_xor(mix32(salt & _M32), bits))
    rounded = ((bits + (noise & mask)) & ~mask).to(torch.int32).view(torch.float32)
    exact = torch.copysign(rounded, x).to(dtype)
    nearest = x.to(dtype)
    special = (bits >= 0x7F800000) | (bits < _FP16_MIN_SUBNORMAL if dtype == torch.float16 else bits < 0)
    return torch.where(special, nearest, exact)


def element_index(rows: Tensor, dim: int, element: tuple[int, int, int] | None = None) -> Tensor:
    """``[len(rows), dim]`` int64: each element's flat index in a ``[R, dim]`` table, for the rows ``rows``
    (:func:`round_stochastic`'s salt; the dense form passes every row, the row-wise form the touched ones).
    ``element``: for a shard of a larger table, ``(first row, first column, the whole table's width)``, so a
    shard's elements take the indices (and so the random bits) they have in the whole table."""
    row0, col0, width = element if element is not None else (0, 0, dim)
    cols = torch.arange(col0, col0 + dim, device=rows.device, dtype=torch.int64)
    return (rows.to(torch.int64).unsqueeze(1) + row0) * width + cols


def low_precision_delta(old: Tensor, new: Tensor, salt: Tensor) -> Tensor:
    """What a row update of a table stored in ``old.dtype`` (float16/bfloat16) adds to ``old``: the float32
    ``new`` rounded stochastically (:func:`round_stochastic`), minus ``old``, in ``old``'s dtype.

    A table's update is written back as this delta, accumulated in the table's dtype (one scatter, as for
    float32 tables), so the row becomes ``old + delta`` rounded to nearest: the stochastically rounded
    value itself whenever it and ``old`` lie within a factor of two of each other (Sterbenz: the
    difference is exact); otherwise (a row crossing zero, or leaving a value near it) it can miss by up to
    about one unit of the larger value's spacing, as the delta itself rounds at that scale.
    The dense form of the update (recir-embed-table-dtype) computes the same sum, so both agree.
    """
    target = round_stochastic(new, old.dtype, salt)
    return (target.float() - old.float()).to(old.dtype)


def dedupe(ids: Tensor, grads: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(rows [N], summed grads [N, D], valid [N])``: slot ``j < #unique`` holds one touched row.

    Slots past the number of unique ids are invalid (``valid`` False, row 0, zero gradient).
    """
    n = ids.shape[0]
    sorted_ids, perm = torch.sort(ids)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)[:1]
    is_new = torch.cat([first, sorted_ids[1:] != sorted_ids[:-1]])
    slot = torch.cumsum(is_new.to(torch.int64), 0) - 1
    rows = torch.zeros_like(sorted_ids).scatter(0, slot, sorted_ids)
    summed = grads.new_zeros(n, grads.shape[1]).index_add(0, slot, grads.index_select(0, perm))
    valid = torch.arange(n, device=ids.device) < is_new.sum()
    return rows, summed, valid


def _row_update(
    kind: str,
    hp: Mapping[str, Any],
    p: Tensor,
    g: Tensor,
    st: dict[str, Tensor],
    lr: Tensor,
    step: Tensor | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The dense optimizer maths (recir.transforms.apply_update, torch.optim's) applied to gathered rows."""
    spec = param_optim(kind, hp)
    if kind == "adagrad" and step is None and not spec.hparams["lr_decay"]:
        step = lr.new_ones(())  # Adagrad reads the step count for its lr decay only
    if kind == "rowwise_adagrad":  # "sum" (recir.capture) or any single [rows] accumulator
        (key,) = st
        new_p, new_st = apply_update(spec, p, g, {"sum": st[key]}, lr, step)
        return new_p, {key: new_st["sum"]}
    return apply_update(spec, p, g, st, lr, step)


def sparse_update(
    kind: str,
    hp: Mapping[str, Any],
    param: Tensor,
    states: Mapping[str, Tensor],
    lr: Tensor,
    step: Tensor | None,
    ids: Tensor,
    grads: Tensor,
    element: tuple[int, int, int] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``(new_param, new_states)`` after a row-wise ``kind`` update of the rows in ``ids`` only
    (``element``: a low-precision shard's place in its table, :func:`element_index`).

    ``states`` maps torch.optim state keys (``sum``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``)
    to tensors whose dim 0 is the table's rows. SGD, Adagrad and RowWiseAdagrad equal the dense update
    exactly (untouched rows have a zero gradient, which leaves them unchanged) unless weight decay is
    set. Adam/AdamW are *lazy*: untouched rows keep their moments and weights, while dense Adam decays
    every row's moments and moves rows whose moment is non-zero (torch.optim.SparseAdam's semantics).
    Weight decay (all optimizers) reaches touched rows only; dense decays every row.
    """
    if kind not in SPARSE_KINDS:
        raise ValueError(f"no row-wise update for optimizer {kind!r}; supported: {SPARSE_KINDS}")
    rows, g, valid = dedupe(ids, grads)
    p = param.index_select(0, rows)
    st = {k: s.index_select(0, rows) for k, s in states.items()}
    low = param.dtype in LOW_PRECISION_BITS  # a table stored fp16/bf16: its update runs in float32
    new_p, new_st = _row_update(kind, hp, p.float() if low else p, g.float() if low else g, st, lr, step)

    def delta(new: Tensor, old: Tensor) -> Tensor:
        mask = valid.view(-1, *([1] * (new.dim() - 1)))
        return torch.where(mask, new - old, torch.zeros_like(new))

    # Accumulating masked deltas (not overwriting): accumulation is defined for repeated indices, so the
    # unused slots (row 0, delta 0) stay harmless when a compiler fuses gather, update and scatter in
    # place. index_put(accumulate=True), not index_add: ATen's CPU index_add costs O(rows).
    # A low-precision row: one scatter of low_precision_delta. (Subtracting the old value, then adding the
    # rounded one, would be exact, but two scatters of one table make XLA copy the table twice per step.)
    if low:
        step_delta = low_precision_delta(p, new_p, element_index(rows, param.shape[1], element))
        out_p = param.index_put((rows,), delta(step_delta, torch.zeros_like(step_delta)), accumulate=True)
    else:
        out_p = param.index_put((rows,), delta(new_p, p), accumulate=True)
    out_st = {k: states[k].index_put((rows,), delta(new_st[k], st[k]), accumulate=True) for k in states}
    return out_p, out_st
