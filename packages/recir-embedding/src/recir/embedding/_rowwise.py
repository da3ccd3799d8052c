"""Row-wise (sparse) updates on a static-size set of touched rows (the maths: recir.transforms.apply_update).

``dedupe`` turns ``(ids [N], per-id grads [N, D])`` into ``N`` slots of unique rows with summed grads
(sort + boundary detection, no data-dependent shapes); ``sparse_update`` applies an optimizer to those
rows and adds the row deltas back with ``index_put(accumulate=True)`` (unused slots add zeros, so duplicates are harmless).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from recir.transforms import apply_update, param_optim
from torch import Tensor

SPARSE_KINDS = (
    "sgd",
    "adagrad",
    "rowwise_adagrad",
    "adam",
    "adamw",
)  # every recir.transforms.OPTIMIZER_KINDS


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
) -> tuple[Tensor, dict[str, Tensor]]:
    """``(new_param, new_states)`` after a row-wise ``kind`` update of the rows in ``ids`` only.

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
    new_p, new_st = _row_update(kind, hp, p, g, st, lr, step)

    def delta(new: Tensor, old: Tensor) -> Tensor:
        mask = valid.view(-1, *([1] * (new.dim() - 1)))
        return torch.where(mask, new - old, torch.zeros_like(new))

    # Accumulating masked deltas (not overwriting): accumulation is defined for repeated indices, so the
    # unused slots (row 0, delta 0) stay harmless when a compiler fuses gather, update and scatter in
    # place. index_put(accumulate=True), not index_add: ATen's CPU index_add costs O(rows).
    out_p = param.index_put((rows,), delta(new_p, p), accumulate=True)
    out_st = {k: states[k].index_put((rows,), delta(new_st[k], st[k]), accumulate=True) for k in states}
    return out_p, out_st
