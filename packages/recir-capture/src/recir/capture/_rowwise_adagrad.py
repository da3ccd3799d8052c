"""RowWiseAdagrad: FBGEMM's row-wise Adagrad as an eager ``torch.optim.Optimizer``.

One accumulator per row (dim 0) holds the running sum of the row's mean squared gradient, so an
embedding table of ``rows x D`` keeps ``rows`` floats of optimizer state instead of ``rows x D``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def rowwise_mean_square(grad: Tensor) -> Tensor:
    """``mean(grad**2)`` over every dim but the first: one value per row (a 1-D param is its own row)."""
    sq = grad * grad
    if sq.dim() <= 1:
        return sq
    return sq.mean(dim=tuple(range(1, sq.dim())))


def rowwise_adagrad_update(
    param: Tensor,
    grad: Tensor,
    state_sum: Tensor,
    *,
    lr: float | Tensor,
    eps: float,
    weight_decay: float,
    maximize: bool,
) -> tuple[Tensor, Tensor]:
    """One functional row-wise Adagrad update; returns ``(new_param, new_sum)`` (shared with capture)."""
    g = -grad if maximize else grad
    if weight_decay != 0:
        g = g + weight_decay * param
    new_sum = state_sum + rowwise_mean_square(g)
    std = new_sum.sqrt() + eps
    scale = lr / std
    new_param = param - scale.reshape(scale.shape + (1,) * (param.dim() - 1)) * g
    return new_param, new_sum


class RowWiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad (FBGEMM ``EmbOptimType.EXACT_ROWWISE_ADAGRAD`` maths), for embedding tables.

    Per row ``r``: ``sum[r] += mean(g[r]**2)``; ``w[r] -= lr * g[r] / (sqrt(sum[r]) + eps)``. State key
    ``sum`` has shape ``[rows]``. Rows with a zero gradient are left unchanged (unless ``weight_decay``
    is set: the dense maths then decays every row, while FBGEMM decays only the rows a batch touches).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        *,
        maximize: bool = False,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or initial_accumulator_value < 0:
            raise ValueError(
                f"RowWiseAdagrad: lr, eps, weight_decay, initial_accumulator_value must be >= 0, got "
                f"{lr}, {eps}, {weight_decay}, {initial_accumulator_value}"
            )
        defaults = {
            "lr": lr,
            "eps": eps,
            "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value,
            "maximize": maximize,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() == 0:
                    raise ValueError("RowWiseAdagrad needs parameters with at least one dimension (rows)")
                self.state[p]["sum"] = torch.full(
                    (p.shape[0],), float(group["initial_accumulator_value"]), dtype=p.dtype, device=p.device
                )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                state = self.state[p]
                new_p, new_sum = rowwise_adagrad_update(
                    p,
                    grad,
                    state["sum"],
                    lr=float(group["lr"]),
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    maximize=group["maximize"],
                )
                p.copy_(new_p)
                state["sum"].copy_(new_sum)
        return loss
