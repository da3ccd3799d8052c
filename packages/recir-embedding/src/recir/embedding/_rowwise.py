"""Row-wise (sparse) optimizer maths on a static-size set of touched rows.

``dedupe`` turns ``(ids [N], per-id grads [N, D])`` into ``N`` slots of unique rows with summed grads
(sort + boundary detection, no data-dependent shapes); ``sparse_update`` applies an optimizer to those
rows and writes them back with ``index_put``. Unused slots repeat slot 0 (same row, same value).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

SPARSE_KINDS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "adamw")


def dedupe(ids: Tensor, grads: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(rows [N], summed grads [N, D], source slot [N])``: slot ``j < #unique`` holds one touched row.

    Slots past the number of unique ids point at slot 0 (``source``), so a write-back repeats it.
    """
    n = ids.shape[0]
    sorted_ids, perm = torch.sort(ids)
    is_new = torch.ones_like(sorted_ids, dtype=torch.bool)
    is_new = torch.cat([is_new[:1], sorted_ids[1:] != sorted_ids[:-1]])
    slot = torch.cumsum(is_new.to(torch.int64), 0) - 1
    rows = torch.zeros_like(sorted_ids).scatter(0, slot, sorted_ids)
    summed = grads.new_zeros(n, grads.shape[1]).index_add(0, slot, grads.index_select(0, perm))
    positions = torch.arange(n, device=ids.device)
    source = torch.where(positions < is_new.sum(), positions, torch.zeros_like(positions))
    return rows.index_select(0, source), summed, source


def sparse_update(
    kind: str,
    hp: Mapping[str, Any],
    param: Tensor,
    states: Sequence[Tensor],
    lr: Tensor,
    step: Tensor | None,
    ids: Tensor,
    grads: Tensor,
) -> list[Tensor]:
    """``[new_param, *new_states]`` after a row-wise ``kind`` update of the rows in ``ids`` only.

    SGD, Adagrad and RowWiseAdagrad equal the dense update exactly (untouched rows have zero gradient,
    which leaves them unchanged). Adam/AdamW are *lazy*: untouched rows keep their moments and
    weights, while dense Adam decays the moments of every row and moves rows whose moment is non-zero;
    weight decay likewise reaches touched rows only.
    """
    rows, g, source = dedupe(ids, grads)
    p = param.index_select(0, rows)
    st = [s.index_select(0, rows) for s in states]
    if kind == "sgd":
        if hp.get("weight_decay"):
            g = g + hp["weight_decay"] * p
        new_p, new_st = p - lr * g, []
    elif kind == "adagrad":
        if hp.get("weight_decay"):
            g = g + hp["weight_decay"] * p
        s = st[0] + g * g
        new_p, new_st = p - lr * g / (s.sqrt() + hp.get("eps", 1e-10)), [s]
    elif kind == "rowwise_adagrad":
        m = st[0] + (g * g).mean(1)
        new_p, new_st = p - lr * g / (m.sqrt() + hp.get("eps", 1e-8)).unsqueeze(1), [m]
    elif kind in ("adam", "adamw"):
        assert step is not None
        b1, b2 = hp.get("betas", (0.9, 0.999))
        wd = hp.get("weight_decay", 0.0)
        if kind == "adamw":
            p = p * (1 - lr * wd)
        elif wd:
            g = g + wd * p
        m = st[0] * b1 + g * (1 - b1)
        v = st[1] * b2 + g * g * (1 - b2)
        bc1 = 1 - torch.pow(b1, step)
        bc2 = 1 - torch.pow(b2, step)
        new_p, new_st = p - (lr / bc1) * m / (v.sqrt() / bc2.sqrt() + hp.get("eps", 1e-8)), [m, v]
    else:
        raise ValueError(f"no row-wise update for optimizer {kind!r}; supported: {SPARSE_KINDS}")
    # Unused slots take slot 0's result, so duplicate writes of a row carry identical values.
    out = [param.index_put((rows,), new_p.index_select(0, source))]
    for s, ns in zip(states, new_st):
        out.append(s.index_put((rows,), ns.index_select(0, source)))
    return out
